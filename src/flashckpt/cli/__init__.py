"""The ``flashckpt`` command line: one module per command group.

Each command module exposes ``register(subparsers)``, which adds its parser(s) and sets
``func=<callable(args) -> int>`` as the parser default. Exit codes: 0 ok, 1 a check found
damage (``verify``), 2 bad usage or any error (one line naming the path and what to do).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Sequence

from flashckpt.errors import FlashCkptError

# Command modules, in the order ``--help`` lists them.
COMMAND_MODULES = (
    "demo",
    "store_cmds",
    "report",
    "status",
    "plan",
    "interop",
    "bench",
    "chaos",
    "run",
)
# Commands whose parser is built alone when they are the one invoked. ``run`` is the launcher:
# it starts the job, stays resident beside it and restarts it, so it must not pay for the other
# modules' imports (several import torch: 0.8 s of CPU and ~200 MB that the launcher would hold,
# on every job start, on cores the job's first step needs).
ALONE = {"run": "run"}


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The whole parser, or with ``only`` (a module of :data:`ALONE`) that module's alone."""
    from flashckpt.version import __version__

    parser = argparse.ArgumentParser(
        prog="flashckpt",
        description="Fast, safe, incremental checkpoints and GPU memory planning for PyTorch.",
    )
    parser.add_argument("--version", action="version", version=f"flashckpt {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress details")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in (only,) if only else COMMAND_MODULES:
        importlib.import_module(f"flashckpt.cli.{name}").register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args_in = list(sys.argv[1:] if argv is None else argv)
    first = next((a for a in args_in if not a.startswith("-")), None)  # -v comes before it
    parser = build_parser(ALONE.get(first) if first else None)
    args = parser.parse_args(args_in)
    if args.command is None:
        parser.print_help()
        return 2
    if args.verbose:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        pkg_log = logging.getLogger("flashckpt")
        pkg_log.addHandler(handler)
        pkg_log.setLevel(logging.INFO)
    try:
        return int(args.func(args) or 0)
    except FlashCkptError as exc:
        print(f"flashckpt {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # a path the command was given cannot be used: one line, not a trace
        where = f" {exc.filename}" if exc.filename else ""
        print(
            f"flashckpt {args.command}: error:{where} {exc.strerror or exc}; check the path and "
            "its permissions",
            file=sys.stderr,
        )
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
