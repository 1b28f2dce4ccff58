"""``flashckpt status ROOT``: the report's numbers as a short text summary for a terminal."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

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
        "--gpu-hour-price", type=float, default=None, metavar="P", help="price per GPU hour"
    )
    p.add_argument("--gpus", type=int, default=None, help="GPUs billed (default: ranks seen)")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    root = Path(args.root)
    if not root.exists():
        raise ConfigError(f"ROOT {root} does not exist; pass the checkpoint root of a run")
    s = summarize(load_events(root), gpu_hour_price=args.gpu_hour_price, gpus=args.gpus)
    print(json.dumps(s.as_dict(), indent=2) if args.json else format_status(s, root=str(root)))
    return 0
