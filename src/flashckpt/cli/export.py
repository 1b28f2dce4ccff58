"""``flashckpt export``: a checkpoint as a plain state_dict file other tools load."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch

from flashckpt.cli import argtypes
from flashckpt.errors import ConfigError, FlashCkptError, StorageError
from flashckpt.integrations.saved import full_tensors

FORMATS = ("safetensors", "torch", "dcp", "hf")
T = TypeVar("T")


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
    p.add_argument(
        "--step", type=argtypes.step, default=None, help="step to export (default: newest)"
    )
    p.add_argument("--format", choices=FORMATS, default="safetensors")
    p.add_argument(
        "--prefix",
        default=None,
        help="export only keys under this state entry (e.g. model), with the prefix "
        "removed, so the file loads with model.load_state_dict (dcp: the model-only form; "
        "hf: the entry holding the model, default model)",
    )
    p.add_argument(
        "--layout",
        choices=("dcp", "torchtitan"),
        default=None,
        help="dcp: DCP's nested layout ({'model': ..., 'optimizer': ...}) or torchtitan's "
        "(model FQNs at the top level beside optimizer, lr_scheduler, train_state, "
        "dataloader); default: torchtitan's when the entries are named as torchtitan names "
        "them",
    )
    p.add_argument(
        "--config",
        default=None,
        help="hf: config.json (or a directory holding one) to write with the weights "
        "(default: the config the saved state carries)",
    )
    p.set_defaults(func=cmd_export)


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


def _writing(out: Path, write: Callable[[], T]) -> T:
    """Run ``write``; an error of the writer (OSError, safetensors' or torch's RuntimeError)
    becomes one StorageError naming ``out`` (the CLI prints one line, exit 2)."""
    try:
        return write()
    except FlashCkptError:
        raise
    except Exception as exc:
        reason = getattr(exc, "strerror", None) or str(exc).splitlines()[0][:200]
        raise StorageError(
            f"cannot write {out} ({type(exc).__name__}: {reason}); choose a writable OUT path"
        ) from None


def cmd_export(args: argparse.Namespace) -> int:
    from flashckpt.cli.roots import open_store, pick_step

    out = Path(args.out)
    if args.layout is not None and (args.format != "dcp" or args.prefix):
        raise ConfigError("--layout applies to --format dcp without --prefix")
    check_output(out, directory=args.format in ("dcp", "hf"))
    if args.format == "hf" or (args.format == "dcp" and not args.prefix):
        from flashckpt.integrations.interop import export

        step = _writing(
            out,
            lambda: export(
                args.root,
                args.out,
                format=args.format,
                step=args.step,
                prefix=args.prefix,
                config=args.config,
                layout=args.layout,
            ),
        )
        print(f"exported step {step} -> {args.out} ({args.format})")
        return 0
    store = open_store(args.root)
    step = pick_step(store, args.step)
    tensors = full_tensors(store, store.load_manifest(step), args.prefix)
    if not tensors:
        raise ConfigError(f"step {step} has no tensors under prefix {args.prefix!r}")
    _writing(out, lambda: _write(tensors, out, args.format, step))
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
