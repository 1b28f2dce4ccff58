"""``flashckpt import``: a DCP checkpoint, safetensors shards or a torch.save file into a store."""

from __future__ import annotations

import argparse
from typing import Any

from flashckpt.cli import argtypes


def register(sub: Any) -> None:
    p = sub.add_parser(
        "import",
        help="bring a DCP checkpoint, safetensors file/shards or torch.save file into a store",
        description="Import SRC as one flashckpt step in ROOT. A flat state_dict lands under "
        "--name (default: model); a flashckpt export without --prefix imports back to its "
        "original entries. DCP metadata is a pickle: import DCP checkpoints you trust.",
    )
    p.add_argument(
        "src",
        metavar="SRC",
        help="DCP directory, .safetensors file or directory, or torch.save file",
    )
    p.add_argument("root", metavar="ROOT", help="flashckpt checkpoint root (created if missing)")
    p.add_argument(
        "--step", type=argtypes.step, default=0, help="step number to save as (default: 0)"
    )
    p.add_argument("--name", default="model", help="state entry for a flat state_dict")
    p.add_argument(
        "--format", choices=("dcp", "safetensors", "torch"), default=None, help="default: detect"
    )
    p.add_argument("--compression", default=None, help="e.g. zstd (default: none)")
    p.set_defaults(func=cmd_import)


def cmd_import(args: argparse.Namespace) -> int:
    from flashckpt.integrations.interop import import_checkpoint

    state = import_checkpoint(
        args.src,
        args.root,
        step=args.step,
        name=args.name,
        format=args.format,
        compression=args.compression,
    )
    print(f"imported {args.src} -> {args.root} step {args.step}: entries {sorted(state)}")
    return 0
