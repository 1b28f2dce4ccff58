"""``flashckpt export``: a checkpoint as a plain state_dict file other tools load."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch

from flashckpt.errors import ConfigError, FlashCkptError, StorageError
from flashckpt.store.manifest import Manifest
from flashckpt.store.store import CheckpointStore

FORMATS = ("safetensors", "torch", "dcp")


def register_export(sub: Any) -> None:
    p = sub.add_parser(
        "export",
        help="write a step as a plain state_dict (safetensors, torch.save or a DCP directory), "
        "sharded steps merged",
    )
    p.add_argument("root", metavar="ROOT")
    p.add_argument("out", metavar="OUT", help="output file (a new directory for --format dcp)")
    p.add_argument("--step", type=int, default=None, help="step to export (default: newest)")
    p.add_argument("--format", choices=FORMATS, default="safetensors")
    p.add_argument(
        "--prefix",
        default=None,
        help="export only keys under this state entry (e.g. model), with the prefix "
        "removed, so the file loads with model.load_state_dict",
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


def check_output(out: Path, *, directory: bool) -> None:
    """Refuse, before reading anything, an output the export cannot write: under a regular
    file, onto an existing directory (file formats) or into a non-empty one (dcp)."""
    parent = out.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise ConfigError(f"cannot write {out}: {parent} is not a directory; choose another OUT")
    if out.is_dir() and not directory:
        raise ConfigError(f"{out} is a directory; give a file name for OUT, e.g. {out}/model.st")
    if out.exists() and directory and not out.is_dir():
        raise ConfigError(f"{out} exists and is not a directory; --format dcp needs a directory")


def cmd_export(args: argparse.Namespace) -> int:
    from flashckpt.cli.store_cmds import open_store, pick_step

    out = Path(args.out)
    check_output(out, directory=args.format == "dcp")
    store = open_store(args.root)
    step = pick_step(store, args.step)
    tensors = full_tensors(store, store.load_manifest(step), args.prefix)
    if not tensors:
        raise ConfigError(f"step {step} has no tensors under prefix {args.prefix!r}")
    try:
        _write(tensors, out, args.format, step)
    except FlashCkptError:
        raise
    except Exception as exc:  # OSError, safetensors' and torch's RuntimeErrors
        reason = getattr(exc, "strerror", None) or str(exc).splitlines()[0][:200]
        raise StorageError(
            f"cannot write {out} ({type(exc).__name__}: {reason}); choose a writable OUT path"
        ) from None
    print(f"exported step {step}: {len(tensors)} tensors -> {out} ({args.format})")
    return 0


def _write(tensors: dict[str, torch.Tensor], out: Path, fmt: str, step: int) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    if fmt == "dcp":
        from flashckpt.integrations.interop import write_dcp

        write_dcp(tensors, out)
    elif fmt == "safetensors":
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
