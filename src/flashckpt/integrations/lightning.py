"""Lightning: a ``CheckpointIO`` plugin that saves through flashckpt.

::

    from flashckpt.integrations.lightning import FlashCkptIO, latest_checkpoint

    io = FlashCkptIO("runs/lit/ckpt", async_save=True)
    trainer = L.Trainer(plugins=[io], callbacks=[io.step_callback()], ...)
    trainer.fit(module, ckpt_path=latest_checkpoint("runs/lit/checkpoints"))  # None: fresh

``step_callback()`` ticks the run marker after every training batch (``Checkpointer.step``), so
the steps a crash loses are counted, not only those up to the last save.

Lightning keeps deciding when to save and which paths to keep (``ModelCheckpoint``: top-k,
``last.ckpt``); each ``.ckpt`` path it asks for becomes a small JSON *pointer file*
``{"flashckpt_root": ..., "step": N}`` and the checkpoint itself is flashckpt step ``N`` (the
``global_step``) in the store at ``root`` (default: ``flashckpt/`` next to the ``.ckpt``
files). ``load_checkpoint`` reads the pointer and restores the step; ``remove_checkpoint``
deletes the pointer and, when no other pointer in that directory names the step, the step.

The Lightning dict is saved as ``{"model": checkpoint["state_dict"], "lightning": rest}``, so
``flashckpt export ROOT model.safetensors --prefix model`` gives the module's state_dict.
Values are converted as follows, never pickled: dict subclasses (``AttributeDict``,
``OrderedDict``) become dicts, ``enum.Enum`` members their ``value``, ``pathlib`` paths strings,
``argparse.Namespace`` a dict. Anything else that is not a tensor, NumPy array or JSON value
raises :class:`~flashckpt.errors.UnsupportedStateError` naming its key (for example an object
in ``hyper_parameters``: ``save_hyperparameters(ignore=[...])`` keeps it out).

With ``async_save=True``, ``save_checkpoint`` returns once the tensors are copied to host
staging memory (the dict holds live parameters, so it cannot return sooner); hashing,
compression and writing continue in the background and ``teardown`` waits for them.
"""

from __future__ import annotations

import argparse
import enum
import json
import logging
import os
import pathlib
from collections.abc import Mapping
from typing import Any

import torch
from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO

from flashckpt.engine.runtime.checkpointer import Checkpointer
from flashckpt.errors import ConfigError, ManifestError
from flashckpt.store.files import safeopen
from flashckpt.store.files.jsonfile import load_json
from flashckpt.store.gc import collect_garbage

log = logging.getLogger(__name__)
POINTER_KEY = "flashckpt_root"
_MAX_POINTER_BYTES = 1 << 16


class FlashCkptIO(CheckpointIO):  # type: ignore[misc]
    """Lightning ``CheckpointIO`` writing to a flashckpt store (see the module docstring).

    Keyword options go to :class:`~flashckpt.Checkpointer` (``async_save``, ``incremental``,
    ``compression``, ...). Retention is Lightning's (``ModelCheckpoint(save_top_k=...)``).
    """

    def __init__(
        self,
        root: str | os.PathLike[str] | None = None,
        *,
        async_save: bool = True,
        incremental: bool = True,
        compression: str | None = None,
        **checkpointer_options: Any,
    ) -> None:
        super().__init__()
        self.root = pathlib.Path(root) if root is not None else None
        self.options: dict[str, Any] = dict(
            async_save=async_save,
            incremental=incremental,
            compression=compression,
            **checkpointer_options,
        )
        self._open: dict[pathlib.Path, Checkpointer] = {}

    # -- CheckpointIO ---------------------------------------------------------------------
    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None
    ) -> None:
        if storage_options is not None:
            raise TypeError(
                "FlashCkptIO.save_checkpoint does not take storage_options; pass Checkpointer "
                "options to FlashCkptIO(...) instead"
            )
        target = pathlib.Path(path)
        root = self._root_for(target)
        step = int(checkpoint.get("global_step", 0))
        ckpt = self._checkpointer(root)
        if ckpt.has_step(step):  # a step is saved once (e.g. epoch end and validation end)
            log.info("flashckpt: step %d is already committed in %s; not saved again", step, root)
        else:
            ckpt.save(step, split_checkpoint(checkpoint))
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(target.name + ".tmp")
        tmp.write_text(json.dumps({POINTER_KEY: str(root.absolute()), "step": step}))
        os.replace(tmp, target)
        log.info("flashckpt: Lightning checkpoint %s -> step %d in %s", target, step, root)

    def load_checkpoint(
        self, path: Any, map_location: Any | None = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        root, step = read_pointer(path)
        holder: dict[str, Any] = {"model": None, "lightning": None}
        self._checkpointer(root).restore(holder, step=step, strict=False)
        checkpoint = dict(holder["lightning"] or {})
        if holder["model"] is not None:
            checkpoint["state_dict"] = holder["model"]
        if isinstance(map_location, (str, torch.device)):
            checkpoint = _to_device(checkpoint, torch.device(map_location))
        return checkpoint

    def remove_checkpoint(self, path: Any) -> None:
        target = pathlib.Path(path)
        if not target.exists():
            return
        root, step = read_pointer(target)
        target.unlink()
        if any(_points_to(p, root, step) for p in target.parent.glob("*.ckpt")):
            return
        ckpt = self._checkpointer(root)
        ckpt.wait()
        if step in ckpt.steps():
            ckpt.store.delete_step(step)
            collect_garbage(ckpt.store)

    def step_callback(self) -> Any:
        """A Lightning ``Callback`` calling ``Checkpointer.step(global_step)`` after every
        training batch (opens the store at ``root`` when given; without a ``root`` it ticks the
        stores opened by a save so far)."""
        from lightning.pytorch.callbacks import Callback

        io = self

        class FlashCkptSteps(Callback):  # type: ignore[misc]
            def on_train_batch_end(self, trainer: Any, *args: Any, **kwargs: Any) -> None:
                io.tick(int(trainer.global_step))

        return FlashCkptSteps()

    def tick(self, step: int) -> None:
        """``Checkpointer.step(step)`` on every store this plugin uses."""
        if self.root is not None:
            self._checkpointer(self.root)
        for ckpt in self._open.values():
            ckpt.step(step)

    def teardown(self) -> None:
        """Wait until every save is durable and release the stores."""
        opened, self._open = self._open, {}
        for ckpt in opened.values():
            ckpt.close()

    # -- helpers --------------------------------------------------------------------------
    def _root_for(self, target: pathlib.Path) -> pathlib.Path:
        return self.root if self.root is not None else target.parent / "flashckpt"

    def _checkpointer(self, root: pathlib.Path) -> Checkpointer:
        key = root.absolute()
        if key not in self._open:
            self._open[key] = Checkpointer(key, **self.options)
        return self._open[key]


def read_pointer(path: Any) -> tuple[pathlib.Path, int]:
    """``(root, step)`` from a FlashCkptIO pointer file; ConfigError for anything else."""
    p = pathlib.Path(path)
    try:
        raw = safeopen.read_path(p, max_bytes=_MAX_POINTER_BYTES, what="Lightning checkpoint")
        doc = load_json(raw, where=str(p), max_bytes=_MAX_POINTER_BYTES, error=ConfigError)
        root, step = pathlib.Path(doc[POINTER_KEY]), doc["step"]
    except FileNotFoundError:
        raise ConfigError(f"Lightning checkpoint {path} does not exist") from None
    except (ValueError, KeyError, TypeError) as exc:  # ConfigError: not a small regular file
        raise ConfigError(
            f"{path} is not a FlashCkptIO pointer file (a regular Lightning .ckpt?); load it "
            "without the FlashCkptIO plugin, or import it: flashckpt import FILE ROOT"
        ) from exc
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ManifestError(f"pointer file {path} names an invalid step {step!r}")
    return root, step


def latest_checkpoint(directory: Any) -> pathlib.Path | None:
    """The ``.ckpt`` pointer file in ``directory`` naming the newest step (None if there is
    none). Compare steps, never names: ``epoch=3-step=64.ckpt`` sorts after
    ``epoch=11-step=192.ckpt`` as text. Files that are not pointers are ignored; on equal steps
    the most recently written wins (``last.ckpt`` next to its twin)."""
    best: tuple[int, float, str] | None = None
    found: pathlib.Path | None = None
    for p in pathlib.Path(directory).glob("*.ckpt"):
        try:
            _root, step = read_pointer(p)
            key = (step, p.stat().st_mtime, p.name)
        except (ConfigError, ManifestError, OSError):
            continue
        if best is None or key > best:
            best, found = key, p
    return found


def _points_to(p: pathlib.Path, root: pathlib.Path, step: int) -> bool:
    try:
        other_root, other_step = read_pointer(p)
    except ConfigError:
        return False
    return other_step == step and other_root.absolute() == root.absolute()


def split_checkpoint(checkpoint: Mapping[str, Any]) -> dict[str, Any]:
    """The flashckpt state for a Lightning checkpoint dict (conversions applied)."""
    rest = {k: to_plain(v, f"lightning/{k}") for k, v in checkpoint.items() if k != "state_dict"}
    state: dict[str, Any] = {"lightning": rest}
    if "state_dict" in checkpoint:
        state["model"] = dict(checkpoint["state_dict"])
    return state


def to_plain(obj: Any, key: str) -> Any:
    """Apply the documented conversions; leave everything else to flashckpt's own checks."""
    if isinstance(obj, enum.Enum):
        return to_plain(obj.value, key)
    if isinstance(obj, pathlib.PurePath):
        return str(obj)
    if isinstance(obj, argparse.Namespace):
        obj = vars(obj)
    if isinstance(obj, Mapping):
        return {k: to_plain(v, f"{key}/{k}") for k, v in obj.items()}
    if isinstance(obj, list):
        return [to_plain(v, f"{key}/{i}") for i, v in enumerate(obj)]
    if isinstance(obj, tuple) and type(obj) is tuple:
        return tuple(to_plain(v, f"{key}/{i}") for i, v in enumerate(obj))
    return obj


def _to_device(obj: Any, device: torch.device) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, dict):
        return {k: _to_device(v, device) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_to_device(v, device) for v in obj]
    return obj
