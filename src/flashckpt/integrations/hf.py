"""Hugging Face ``transformers.Trainer``: save and resume through flashckpt.

Two pieces::

    from flashckpt.integrations.hf import FlashCkptCallback, resume

    trainer = Trainer(model, args, train_dataset=ds,
                      callbacks=[FlashCkptCallback("runs/gpt/ckpt", async_save=True)])
    resume(trainer)          # instead of trainer.train(): newest flashckpt step, or a fresh start

**Saving.** The Trainer still decides *when* (``save_strategy``, ``save_steps``); on those steps
:class:`FlashCkptCallback` saves ``{"model", "optim", "sched", "rng", "trainer"}`` through a
:class:`~flashckpt.Checkpointer` (async, incremental, retention ``keep=``) and clears
``control.should_save``, so the Trainer writes no ``checkpoint-N`` directory of its own.
``"trainer"`` is the ``TrainerState`` as JSON (global step, epoch, log history, ...). The
model's config and generation config go with every save of a ``transformers`` model (the
manifest's ``meta``, state/capture.py), so ``flashckpt export ROOT DIR --format hf`` writes the
``config.json`` that ``from_pretrained(DIR)`` needs.

**Resuming.** :func:`resume` calls ``trainer.train(resume_from_checkpoint=...)`` with a
temporary directory holding only that ``trainer_state.json``, so the Trainer's own resume logic
runs unchanged: it restores the step counters, skips the batches already trained in the current
epoch and restores the RNG state at the point it would have. For the duration of that call the
Trainer's four checkpoint *loading* methods (``_load_from_checkpoint``,
``_load_optimizer_and_scheduler``, ``_load_scaler``, ``_load_rng_state``) are replaced on this
instance by flashckpt restores; they are private Trainer methods, tested against transformers 5.

**Under torchrun (DDP)** every rank runs the callback on the same steps, so every rank saves its
part through flashckpt's distributed commit (replicated weights written once, per-rank RNG and
``TrainerState``), and :func:`resume` is called on every rank; tested with 2 gloo ranks.

Known limits: DDP is what is tested (not accelerate's FSDP or DeepSpeed plugins); the fp16
``GradScaler`` and the states of ``ExportableState`` callbacks other than ``TrainerControl``
(e.g. early stopping) are not saved; the saved ``TrainerState`` is taken when the step ends, so
its ``log_history`` lacks the log line of the saved step itself and ``total_flos`` lags by the
last interval.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import tempfile
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

from flashckpt.engine.runtime.checkpointer import Checkpointer
from flashckpt.errors import ConfigError, NoCheckpointError
from flashckpt.state.rng import RNG

log = logging.getLogger(__name__)

TRAINER_STATE_NAME = "trainer_state.json"


def unwrap(obj: Any) -> Any:
    """The torch optimizer / scheduler inside an accelerate wrapper (or ``obj`` itself)."""
    for attr in ("optimizer", "scheduler"):
        inner = getattr(obj, attr, None)
        if (
            inner is not None
            and hasattr(inner, "state_dict")
            and type(obj).__module__.startswith("accelerate")
        ):
            return inner
    return obj


class FlashCkptCallback(TrainerCallback):  # type: ignore[misc]
    """Save the Trainer's checkpoints to the flashckpt store at ``root``.

    Keyword options go to :class:`~flashckpt.Checkpointer` (``async_save``, ``incremental``,
    ``compression``, ``keep``, ``host_memory_budget``, ...). The Checkpointer opens on first use
    and closes (waiting until the last save is durable) when training ends.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        async_save: bool = True,
        incremental: bool = True,
        compression: str | None = None,
        keep: Any = None,
        **checkpointer_options: Any,
    ) -> None:
        self.root = Path(root)
        self.options: dict[str, Any] = dict(
            async_save=async_save,
            incremental=incremental,
            compression=compression,
            keep=keep,
            **checkpointer_options,
        )
        self._ckpt: Checkpointer | None = None
        self._last_saved: int | None = None

    def checkpointer(self) -> Checkpointer:
        """The open Checkpointer (opened now if needed)."""
        if self._ckpt is None:
            self._ckpt = Checkpointer(self.root, **self.options)
        return self._ckpt

    def close(self) -> None:
        """Wait until the last save is durable and release the store."""
        ckpt, self._ckpt = self._ckpt, None
        if ckpt is not None:
            ckpt.close()

    # -- Trainer events -------------------------------------------------------------------
    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.checkpointer().step(int(state.global_step))  # steps lost to a crash are counted
        self._maybe_save(state, control, kwargs)

    def on_epoch_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._maybe_save(state, control, kwargs)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.close()

    def _maybe_save(self, state: Any, control: Any, kw: dict[str, Any]) -> None:
        if not control.should_save:
            return
        control.should_save = False  # the Trainer writes no checkpoint-N directory
        step = int(state.global_step)
        if step == self._last_saved:
            return  # already saved (a step end followed by the epoch end)
        ckpt = self.checkpointer()
        if ckpt.has_step(step):  # committed by an earlier run: a step is saved once
            log.info(
                "flashckpt: Trainer step %d is already in %s; not saved again", step, self.root
            )
            self._last_saved = step
            return
        ckpt.save(step, self.training_state(state, control, kw))
        self._last_saved = step
        log.info("flashckpt: saved Trainer step %d to %s", step, self.root)

    @staticmethod
    def training_state(state: Any, control: Any, kw: dict[str, Any]) -> dict[str, Any]:
        """What one checkpoint holds (see the module docstring)."""
        trainer_json = json.loads(json.dumps(dataclasses.asdict(state)))  # as save_to_json
        cbs = trainer_json.setdefault("stateful_callbacks", {})
        cbs[type(control).__name__] = control.state()
        out: dict[str, Any] = {"model": kw["model"], "rng": RNG(), "trainer": trainer_json}
        if kw.get("optimizer") is not None:
            out["optim"] = unwrap(kw["optimizer"])
        if kw.get("lr_scheduler") is not None:
            out["sched"] = unwrap(kw["lr_scheduler"])
        return out


def find_callback(trainer: Any) -> FlashCkptCallback:
    """The trainer's :class:`FlashCkptCallback`; ConfigError when it has none."""
    for cb in trainer.callback_handler.callbacks:
        if isinstance(cb, FlashCkptCallback):
            return cb
    raise ConfigError(
        "this Trainer has no FlashCkptCallback: pass callbacks=[FlashCkptCallback(root)] to "
        "Trainer(...) before calling resume()"
    )


def resume(trainer: Any, *, step: int | None = None, **train_kwargs: Any) -> Any:
    """``trainer.train()`` resumed from flashckpt step ``step`` (default: newest).

    With no checkpoint in the store (and ``step`` None) this is a fresh ``trainer.train()``.
    Returns what ``train()`` returns. Raises NoCheckpointError for a ``step`` not in the store.
    """
    if "resume_from_checkpoint" in train_kwargs:
        raise ConfigError("resume() chooses the checkpoint; pass step= instead")
    cb = find_callback(trainer)
    ckpt = cb.checkpointer()
    steps = ckpt.steps()
    if step is None and not steps:
        log.info("flashckpt: no checkpoint in %s; training from the start", cb.root)
        return trainer.train(**train_kwargs)
    step = steps[-1] if step is None else step
    if step not in steps:
        raise NoCheckpointError(f"step {step} is not in {cb.root}; steps: {steps}")
    holder: dict[str, Any] = {"trainer": None}
    ckpt.restore(holder, step=step)
    try:
        with tempfile.TemporaryDirectory(prefix="flashckpt-hf-") as tmp:
            path = Path(tmp) / f"checkpoint-{step}"
            path.mkdir()
            (path / TRAINER_STATE_NAME).write_text(json.dumps(holder["trainer"]))
            with _loading_from(trainer, ckpt, step):
                return trainer.train(resume_from_checkpoint=str(path), **train_kwargs)
    finally:
        cb.close()


@contextmanager
def _loading_from(trainer: Any, ckpt: Checkpointer, step: int) -> Iterator[None]:
    """Replace the Trainer's checkpoint loaders on this instance with flashckpt restores."""

    def load_model(self: Any, _checkpoint: str, model: Any = None) -> None:
        ckpt.restore({"model": model if model is not None else self.model}, step=step)

    def load_optim(self: Any, checkpoint: str | None) -> None:
        if checkpoint is not None:
            ckpt.restore(
                {"optim": unwrap(self.optimizer), "sched": unwrap(self.lr_scheduler)}, step=step
            )

    def load_scaler(self: Any, checkpoint: str | None) -> None:
        return None

    def load_rng(self: Any, checkpoint: str | None) -> None:
        if checkpoint is not None:
            ckpt.restore({"rng": RNG()}, step=step)

    patches: dict[str, Callable[..., Any]] = {
        "_load_from_checkpoint": load_model,
        "_load_optimizer_and_scheduler": load_optim,
        "_load_scaler": load_scaler,
        "_load_rng_state": load_rng,
    }
    for name, fn in patches.items():
        setattr(trainer, name, types.MethodType(fn, trainer))
    try:
        yield
    finally:
        for name in patches:
            vars(trainer).pop(name, None)
