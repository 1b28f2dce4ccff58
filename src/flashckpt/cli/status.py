"""``flashckpt status ROOT``: the report's numbers as a short text summary for a terminal."""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from flashckpt.cli import argtypes
from flashckpt.errors import ConfigError
from flashckpt.report.summary import load_events, summarize
from flashckpt.report.terminal import format_status


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "status",
        help="summarize a run: saves, stalls, failures, interval, goodput, cost",
        description="Print the run journal of ROOT as a short summary.",
    )
    p.add_argument("root", metavar="ROOT", help="checkpoint root (holds journal.jsonl)")
    p.add_argument(
        "--gpu-hour-price",
        type=argtypes.price,
        default=None,
        metavar="P",
        help="price per GPU hour",
    )
    p.add_argument(
        "--gpus", type=argtypes.count, default=None, help="GPUs billed (default: ranks seen)"
    )
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    root = Path(args.root)
    if not root.exists():
        raise ConfigError(f"ROOT {root} does not exist; pass the checkpoint root of a run")
    events = load_events(root)
    s = summarize(events, gpu_hour_price=args.gpu_hour_price, gpus=args.gpus)
    rep = _replication(events)
    if args.json:
        print(json.dumps({**s.as_dict(), **({"replication": rep} if rep else {})}, indent=2))
        return 0
    print(format_status(s, root=str(root)))
    if rep:
        last = rep["last_replicated_step"]
        print(
            f"peer replication: {rep['replicated']} step(s) replicated (newest {last}), "
            f"{rep['failed']} failed, {rep['skipped']} skipped"
            + (" -- stopped" if rep["stopped"] else "")
        )
    return 0


def _replication(events: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """What the journal says about peer replication ({} when it never ran)."""
    done = [e for e in events if e.get("event") == "replicated"]
    failed = [e for e in events if e.get("event") == "replication_failed"]
    skipped = [e for e in events if e.get("event") == "replication_skipped"]
    if not (done or failed or skipped):
        return {}
    return {
        "replicated": len(done),
        "last_replicated_step": max((int(e["step"]) for e in done), default=None),
        "failed": len({e.get("step") for e in failed}),
        "skipped": sum(len(e.get("steps", [])) for e in skipped),
        "stopped": any(e.get("stopped") for e in failed),
    }
