"""``flashckpt run``: a training script with a warm standby (distributed/standby/supervise.py)."""

from __future__ import annotations

import argparse
from typing import Any

from flashckpt.cli.argtypes import integer
from flashckpt.errors import ConfigError


def register(sub: Any) -> None:
    p = sub.add_parser(
        "run",
        help="run a training script with a warm standby that takes over when it dies",
        description="Starts the script and, with --standby 1, a standby copy of it that builds "
        "everything and waits inside Checkpointer.restore() at idle CPU priority. When the "
        "script dies (any exit code but 0, or a signal), the standby restores from the memory "
        "tier and continues, and a new standby starts; with no standby ready the script is "
        "started again. With --nproc-per-node N both are sets of N ranks (torchrun's "
        "variables, a fresh rendezvous port per set). Exit code: the script's.",
    )
    p.add_argument(
        "--standby",
        type=integer(low=0, high=1, what="0 or 1"),
        default=1,
        help="standby sets: 0 or 1 (default 1)",
    )
    p.add_argument(
        "--nproc-per-node",
        type=integer(low=1, high=1024, what="a number of ranks"),
        default=1,
        help="ranks per set (default 1)",
    )
    p.add_argument(
        "--max-restarts",
        type=integer(low=0, high=10**6, what="a number of restarts"),
        default=100,
        help="takeovers + cold restarts (default 100)",
    )
    p.add_argument("--state-file", default=None, help="keep the pids and counts in this JSON")
    p.add_argument("cmd", nargs=argparse.REMAINDER, help="-- the command, e.g. python train.py")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from flashckpt.distributed.standby.supervise import run as supervise

    cmd = list(args.cmd)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        raise ConfigError("flashckpt run needs a command after --, e.g. -- python train.py")
    return supervise(
        cmd,
        nproc=args.nproc_per_node,
        standby=args.standby,
        max_restarts=args.max_restarts,
        state_file=args.state_file,
    )
