"""``flashckpt demo``: the whole story on a small GPT, on CPU or GPU."""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from flashckpt.cli import argtypes


def register(sub: Any) -> None:
    p = sub.add_parser(
        "demo",
        help="plan, train with tiered async checkpoints, crash, resume exactly, report",
        description="Trains a small GPT on a corpus shipped with flashckpt (about two minutes on "
        "2 CPU cores), kills the training process mid-run, resumes from the memory tier and "
        "writes the report.",
    )
    p.add_argument("--dir", default=None, help="output directory (default: runs/demo-<time>)")
    p.add_argument("--steps", type=argtypes.count, default=200, help="training steps (default 200)")
    p.add_argument(
        "--every", type=argtypes.count, default=20, help="checkpoint every N steps (default 20)"
    )
    p.add_argument(
        "--crash-at", type=argtypes.count0, default=None, help="step at which to kill training"
    )
    p.add_argument(
        "--nproc", type=argtypes.count, default=1, help="ranks (2: FSDP2 under torchrun on CPU)"
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    out = Path(args.dir or f"runs/demo-{time.strftime('%Y%m%d-%H%M%S')}")
    from flashckpt.demo.run import run_demo

    return run_demo(
        out=out, steps=args.steps, every=args.every, crash_at=args.crash_at, nproc=args.nproc
    )
