"""``flashckpt report ROOT``: write the HTML run report (one offline page with plots)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from flashckpt.cli import argtypes
from flashckpt.errors import ConfigError, StorageError
from flashckpt.report.html import write_report
from flashckpt.report.summary import load_events, summarize


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "report",
        help="write an HTML report: stalls, throughput, memory, intervals, failures, goodput",
        description="Build one self-contained HTML page (no network needed to view it) from "
        "the run journal in ROOT.",
    )
    p.add_argument("root", metavar="ROOT", help="checkpoint root (holds journal.jsonl)")
    p.add_argument(
        "-o", "--output", default="report.html", help="HTML file to write (default: report.html)"
    )
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
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    root = Path(args.root)
    if not root.exists():
        raise ConfigError(f"ROOT {root} does not exist; pass the checkpoint root of a run")
    try:
        out = write_report(
            root, output=args.output, gpu_hour_price=args.gpu_hour_price, gpus=args.gpus
        )
    except OSError as exc:
        raise StorageError(
            f"cannot write the report {args.output} ({exc.strerror or exc}); pass a writable "
            "path with -o"
        ) from None
    s = summarize(load_events(root), gpu_hour_price=args.gpu_hour_price, gpus=args.gpus)
    note = "no journal events yet" if s.events == 0 else f"{s.saves} saves, {s.events} events"
    print(f"wrote {out} ({note})")
    return 0
