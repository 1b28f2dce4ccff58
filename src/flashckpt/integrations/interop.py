"""Checkpoints in and out: DCP, safetensors and ``torch.save`` files.

Export (``flashckpt export ROOT OUT --format dcp|safetensors|torch|hf``): ``dcp`` without a
prefix writes the nested layout DCP itself writes (:mod:`flashckpt.integrations.dcp_layout`),
``hf`` a ``from_pretrained`` directory (:mod:`flashckpt.integrations.hf_export`). The others
write the torch tensors of one step, full (shards merged), as a *flat* dict
``{flashckpt key: tensor}``; keys are the
flashckpt keys (``model/transformer.h.0.attn.c_attn.weight``, ``optim/state/0/exp_avg``), or,
with ``prefix="model"``, the keys under that entry with the prefix removed, so the result loads
with ``model.load_state_dict``. Only tensors travel: JSON values (step counters, learning rates)
and NumPy arrays (RNG states) stay behind.

Import (``flashckpt import SRC ROOT``) reads a DCP checkpoint directory, a ``torch.save`` file
(``torch.load(..., weights_only=True)``) or a safetensors file or directory of shards, and saves
it as one flashckpt step. A flat ``{key: tensor}`` dict becomes ``{name: {key: tensor}}`` (name
``"model"`` by default) unless every key has a ``/`` (a flashckpt export without a prefix), in
which case the part before the first ``/`` is the state entry again, so an export imports back
to the same layout. A ``torch.save`` dict that is not flat (``{"model": sd, "step": 3}``) is kept
as given, each top-level key one state entry.

Trust: nothing read from an import source runs code. Format detection never picks a pickled
format: a directory is imported as safetensors shards, a file as safetensors (``.safetensors``)
or as a ``torch.save`` file loaded with ``weights_only=True``. A DCP checkpoint's ``.metadata``
is a pickle, so a DCP directory is read only when asked for with ``format="dcp"``
(``--format dcp``), and then through a restricted unpickler that builds DCP's metadata classes
only and refuses anything else (:mod:`flashckpt.integrations.dcp_metadata`); its storage records
must name data files inside the directory. DCP entries stored as pickled bytes are skipped with
a warning (they would be unpickled by DCP itself).
"""

from __future__ import annotations

import logging
import os
import stat
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from flashckpt.errors import ConfigError, NoCheckpointError, UnsupportedStateError
from flashckpt.integrations.dcp_metadata import SINGLE_PROCESS as _SINGLE_PROCESS
from flashckpt.integrations.dcp_metadata import load_dcp

log = logging.getLogger(__name__)

FORMATS = ("dcp", "torch", "safetensors")
EXPORT_FORMATS = (*FORMATS, "hf")
_NO_SAFETENSORS = "safetensors is not installed: pip install 'flashckpt[safetensors]'"


# -- export -------------------------------------------------------------------------------
def read_tensors(
    root: str | os.PathLike[str], *, step: int | None = None, prefix: str | None = None
) -> tuple[int, dict[str, torch.Tensor]]:
    """``(step, {key: full tensor on CPU})`` of a committed step (newest when ``step`` is None)."""
    from flashckpt.integrations.saved import full_tensors
    from flashckpt.store.files.backend import LocalBackend
    from flashckpt.store.store import CheckpointStore

    path = Path(root).expanduser()
    if not (path / "steps").is_dir():
        raise ConfigError(f"{root} is not a flashckpt checkpoint root (no steps/ directory)")
    store = CheckpointStore(LocalBackend(path, create=False))
    steps = store.steps()
    if not steps:
        raise NoCheckpointError(f"{root} holds no checkpoint")
    if step is None:
        step = steps[-1]
    elif step not in steps:
        raise NoCheckpointError(f"step {step} is not in {root}; steps: {steps}")
    tensors = full_tensors(store, store.load_manifest(step), prefix)
    if not tensors:
        raise ConfigError(f"step {step} of {root} has no tensors under prefix {prefix!r}")
    return step, tensors


def write_dcp(tensors: Mapping[str, torch.Tensor], out: str | os.PathLike[str]) -> None:
    """Write ``tensors`` as a single-process DCP checkpoint directory ``out``."""
    import torch.distributed.checkpoint as dcp

    out_path = Path(out)
    if out_path.exists() and any(out_path.iterdir()):
        raise ConfigError(f"{out} exists and is not empty; DCP output needs a new directory")
    out_path.mkdir(parents=True, exist_ok=True)
    state = {k: v.contiguous() for k, v in tensors.items()}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_SINGLE_PROCESS)
        dcp.save(state, storage_writer=dcp.FileSystemWriter(str(out_path)), no_dist=True)


def write_safetensors(
    tensors: Mapping[str, torch.Tensor], out: str | os.PathLike[str], *, step: int
) -> None:
    """Write ``tensors`` as one safetensors file (metadata ``{"step": step}``)."""
    try:
        from safetensors.torch import save_file
    except ImportError as exc:
        raise ConfigError(
            "safetensors is not installed: pip install 'flashckpt[safetensors]'"
        ) from exc
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    save_file(
        {k: v.contiguous() for k, v in tensors.items()}, str(out), metadata={"step": str(step)}
    )


def export(
    root: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    format: str = "safetensors",
    step: int | None = None,
    prefix: str | None = None,
    config: Any = None,
    layout: str | None = None,
) -> int:
    """Export one step of ``root`` to ``out`` (a directory for ``dcp``); returns the step.

    ``dcp`` without a prefix is the nested layout of :mod:`flashckpt.integrations.dcp_layout`,
    or torchtitan's (:mod:`flashckpt.integrations.torchtitan`) with ``layout="torchtitan"`` and,
    when ``layout`` is None, whenever the step's entries are named as torchtitan names them;
    ``hf`` is a ``from_pretrained`` directory (:mod:`flashckpt.integrations.hf_export`).
    """
    from flashckpt.integrations import torchtitan

    if format not in EXPORT_FORMATS:
        raise ConfigError(f"format must be one of {EXPORT_FORMATS}, got {format!r}")
    if layout not in (None, *torchtitan.LAYOUTS):
        raise ConfigError(f"layout must be one of {torchtitan.LAYOUTS}, got {layout!r}")
    if layout is not None and (format != "dcp" or prefix is not None):
        raise ConfigError("--layout applies to --format dcp without --prefix")
    if format == "dcp" and prefix is None:  # nested, in DCP's own layout or torchtitan's
        from flashckpt.integrations.dcp_layout import export_dcp as export_nested

        if layout == "torchtitan" or (
            layout is None and torchtitan.is_torchtitan_entries(torchtitan.entry_names(root, step))
        ):
            return torchtitan.export_torchtitan(root, out, step=step)
        return export_nested(root, out, step=step)
    if format == "hf":
        from flashckpt.integrations.hf_export import export_hf

        return export_hf(root, out, step=step, prefix=prefix or "model", config=config)
    step, tensors = read_tensors(root, step=step, prefix=prefix)
    if format == "dcp":
        write_dcp(tensors, out)
    elif format == "safetensors":
        write_safetensors(tensors, out, step=step)
    else:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        torch.save(tensors, out)
    log.info("exported step %d of %s: %d tensors -> %s (%s)", step, root, len(tensors), out, format)
    return step


def export_dcp(
    root: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    step: int | None = None,
    prefix: str | None = None,
) -> int:
    """Export one step as a DCP checkpoint that ``torch.distributed.checkpoint.load`` reads."""
    return export(root, out, format="dcp", step=step, prefix=prefix)


# -- import -------------------------------------------------------------------------------
def detect_format(src: str | os.PathLike[str]) -> str:
    """``"safetensors"`` or ``"torch"`` for ``src``; ConfigError when neither fits. Never
    ``"dcp"``: DCP metadata is a pickle, so reading it must be asked for explicitly."""
    p = Path(src)
    if not p.exists():
        raise ConfigError(f"import source {src} does not exist")
    if p.is_dir():
        if any(p.glob("*.safetensors")):
            return "safetensors"
        if (p / ".metadata").exists():
            raise ConfigError(
                f"{src} looks like a DCP checkpoint; its .metadata is a pickle, so flashckpt "
                "reads it only when asked: pass --format dcp (format='dcp'), and it is then "
                "read with a restricted unpickler that admits DCP's metadata classes only"
            )
        raise ConfigError(
            f"{src} is a directory with neither a DCP .metadata file nor *.safetensors shards; "
            "import takes a safetensors file or directory of shards, a torch.save file, or "
            "(with --format dcp) a DCP checkpoint directory"
        )
    return "safetensors" if p.suffix == ".safetensors" else "torch"


def _check_regular(path: Path) -> None:
    """An import source file must be a regular file (a FIFO or device would hang the read)."""
    try:
        st = path.stat()
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc.strerror}") from None
    if not stat.S_ISREG(st.st_mode):
        raise ConfigError(f"{path} is not a regular file; import reads regular files only")


def load_safetensors(src: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors file, or of all ``*.safetensors`` shards in a directory."""
    try:
        from safetensors import safe_open
    except ImportError as exc:
        raise ConfigError(
            "safetensors is not installed: pip install 'flashckpt[safetensors]'"
        ) from exc
    p = Path(src)
    files = sorted(p.glob("*.safetensors")) if p.is_dir() else [p]
    out: dict[str, torch.Tensor] = {}
    for f in files:
        _check_regular(f)
        try:
            with safe_open(str(f), framework="pt") as fh:
                for key in fh.keys():  # noqa: SIM118 - safe_open is not a Mapping
                    if key in out:
                        raise ConfigError(f"tensor {key!r} appears in more than one shard ({f})")
                    out[key] = fh.get_tensor(key)
        except ConfigError:
            raise
        except Exception as exc:
            raise ConfigError(f"{f} is not a readable safetensors file: {exc}") from exc
    return out


def load_torch(src: str | os.PathLike[str]) -> Any:
    """A ``torch.save`` file, loaded with ``weights_only=True`` (no code runs)."""
    _check_regular(Path(src))
    try:
        return torch.load(src, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise ConfigError(
            f"{src} is not a DCP directory, a safetensors file or a torch.save file that loads "
            f"with weights_only=True ({type(exc).__name__}: {str(exc).splitlines()[0][:200]})"
        ) from exc


def as_state(obj: Any, *, name: str = "model") -> dict[str, Any]:
    """The flashckpt state for a loaded object (see the module docstring for the rules)."""
    if not isinstance(obj, Mapping):
        raise UnsupportedStateError(
            f"the imported object is a {type(obj).__name__}, not a dict; import expects a "
            "state_dict or a dict of state entries"
        )
    keys = list(obj)
    if keys and all(isinstance(v, torch.Tensor) for v in obj.values()):
        if all(isinstance(k, str) and "/" in k.strip("/") for k in keys):
            nested: dict[str, dict[str, torch.Tensor]] = {}
            for k, v in obj.items():
                head, _, rest = k.partition("/")
                nested.setdefault(head, {})[rest] = v
            return dict(nested)
        return {name: dict(obj)}
    bad = [k for k in keys if not isinstance(k, str) or not k or "/" in k]
    if bad:
        raise UnsupportedStateError(
            f"top-level key {bad[0]!r} cannot name a state entry (must be a non-empty string "
            "without '/'); re-save the file as {'model': state_dict, ...}"
        )
    return dict(obj)


def import_checkpoint(
    src: str | os.PathLike[str],
    root: str | os.PathLike[str],
    *,
    step: int = 0,
    name: str = "model",
    format: str | None = None,
    compression: str | None = None,
) -> dict[str, Any]:
    """Import ``src`` into the flashckpt store at ``root`` as ``step``; returns the state saved.

    ``format`` is detected when None. Raises :class:`~flashckpt.errors.ConfigError` when
    ``src`` is none of the formats or ``step`` already exists in ``root``.
    """
    from flashckpt.engine.runtime.checkpointer import Checkpointer

    fmt = format or detect_format(src)
    if fmt == "dcp":
        from flashckpt.integrations.dcp_layout import is_nested, nest_dcp
        from flashckpt.integrations.torchtitan import is_torchtitan_dcp, nest_titan

        # {"model": ..., "optim": ...} as dcp.save flattened it, torchtitan's layout, or flat
        flat = load_dcp(src, values=True)
        tensors = {k: v for k, v in flat.items() if isinstance(v, torch.Tensor)}
        if is_torchtitan_dcp(flat):
            state = nest_titan(flat)
        else:
            left = sorted(set(flat) - set(tensors))
            if left:
                log.warning(
                    "import: left out %d DCP values that are not tensors (%s%s)",
                    len(left),
                    ", ".join(left[:3]),
                    ", ..." if len(left) > 3 else "",
                )
            state = nest_dcp(tensors) if is_nested(tensors) else as_state(tensors, name=name)
    elif fmt == "safetensors":
        state = as_state(load_safetensors(src), name=name)
    elif fmt == "torch":
        state = as_state(load_torch(src), name=name)
    else:
        raise ConfigError(f"format must be one of {FORMATS}, got {fmt!r}")
    with Checkpointer(root, compression=compression) as ckpt:
        if step in ckpt.steps():
            raise ConfigError(f"step {step} already exists in {root}; choose another --step")
        ckpt.save(step, state)
    log.info("imported %s (%s) into %s as step %d", src, fmt, root, step)
    return state
