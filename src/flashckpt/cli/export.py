"""``flashckpt export``: a checkpoint as a plain state_dict file other tools load."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch

from flashckpt.errors import ConfigError
from flashckpt.store.manifest import Manifest
from flashckpt.store.store import CheckpointStore

FORMATS = ("safetensors", "torch", "dcp", "hf")


def register_export(sub: Any) -> None:
    p = sub.add_parser(
        "export",
        help="write a step as a plain state_dict (safetensors, torch.save), a DCP directory in "
        "DCP's own layout, or a Hugging Face from_pretrained directory; sharded steps merged",
    )
    p.add_argument("root", metavar="ROOT")
    p.add_argument(
        "out", metavar="OUT", help="output file (a new directory for --format dcp and hf)"
    )
    p.add_argument("--step", type=int, default=None, help="step to export (default: newest)")
    p.add_argument("--format", choices=FORMATS, default="safetensors")
    p.add_argument(
        "--prefix",
        default=None,
        help="export only keys under this state entry (e.g. model), with the prefix "
        "removed, so the file loads with model.load_state_dict (dcp: the model-only form; "
        "hf: the entry holding the model, default model)",
    )
    p.add_argument(
        "--config",
        default=None,
        help="hf: config.json (or a directory holding one) to write with the weights "
        "(default: the config the saved state carries)",
    )
    p.set_defaults(func=cmd_export)


def full_tensors(
    store: CheckpointStore, manifest: Manifest, prefix: str | None
) -> dict[str, torch.Tensor]:
    """Every torch tensor of a checkpoint, full (shards merged), on CPU."""
    from flashckpt.engine.reader import read_tensors

    keys = [
        k
        for k, e in manifest.tensors.items()
        if e.kind == "torch" and (not prefix or k.startswith(prefix + "/"))
    ]
    loaded = read_tensors(store, manifest, keys)
    if prefix:
        return {k[len(prefix) + 1 :]: v for k, v in loaded.items()}
    return dict(loaded)


def cmd_export(args: argparse.Namespace) -> int:
    from flashckpt.cli.store_cmds import open_store, pick_step

    if args.format == "hf" or (args.format == "dcp" and not args.prefix):
        from flashckpt.integrations.interop import export

        step = export(
            args.root,
            args.out,
            format=args.format,
            step=args.step,
            prefix=args.prefix,
            config=args.config,
        )
        print(f"exported step {step} -> {args.out} ({args.format})")
        return 0
    store = open_store(args.root)
    step = pick_step(store, args.step)
    tensors = full_tensors(store, store.load_manifest(step), args.prefix)
    if not tensors:
        raise ConfigError(f"step {step} has no tensors under prefix {args.prefix!r}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if args.format == "dcp":
        from flashckpt.integrations.interop import write_dcp

        write_dcp(tensors, out)
    elif args.format == "safetensors":
        try:
            from safetensors.torch import save_file
        except ImportError as exc:
            raise ConfigError(
                "export --format safetensors needs: pip install 'flashckpt[safetensors]'"
            ) from exc
        save_file(
            {k: v.contiguous() for k, v in tensors.items()}, str(out), metadata={"step": str(step)}
        )
    else:
        torch.save(tensors, out)
    print(f"exported step {step}: {len(tensors)} tensors -> {out} ({args.format})")
    return 0
