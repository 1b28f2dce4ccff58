"""A drop-in checkpoint manager for torchtitan that saves and restores through flashckpt.

torchtitan's trainer builds its checkpointer as ``config.checkpoint.build(dataloader=...,
model_parts=..., optimizers=..., lr_schedulers=..., states={"train_state": trainer},
sd_adapter=..., base_folder=...)`` and then calls ``load(step=...)``, ``save(step,
last_step=...)``, ``maybe_wait_for_staging()`` and ``close()``. :class:`FlashCheckpointManager`
takes the same arguments and answers the same calls, so replacing the manager is one line
(for instance in a subclass of torchtitan's ``Trainer``, or by monkeypatching
``CheckpointManager`` before the trainer is built)::

    from torchtitan_checkpointer import FlashCheckpointManager
    trainer.checkpointer = FlashCheckpointManager(
        config.checkpoint, dataloader=trainer.dataloader, model_parts=trainer.model_parts,
        optimizers=trainer.optimizers, lr_schedulers=trainer.lr_schedulers,
        states={"train_state": trainer}, base_folder=config.dump_folder)

The state saved is the one torchtitan's manager saves, under torchtitan's names (``model``,
``optimizer``, ``lr_scheduler``, ``train_state``, ``dataloader``), so ``flashckpt export ROOT
OUT --format dcp`` writes a DCP checkpoint torchtitan's own manager loads (torchtitan's
layout is picked automatically from those names), and ``flashckpt import TITAN_STEP_DIR ROOT
--format dcp`` brings a torchtitan checkpoint here. FSDP2 shards are saved and restored as
shards (any world size on restore). Saves are asynchronous and incremental; ``close()`` waits
until the last one is durable.

Only torch and flashckpt are imported here: the objects torchtitan passes in are used through
their ``state_dict`` / ``load_state_dict``.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

import flashckpt
from flashckpt.integrations.torchtitan import BytesState

log = logging.getLogger(__name__)


class ModelParts(torch.nn.Module):
    """Several model parts (pipeline stages) as one module whose state_dict is their union,
    keyed by each part's own FQNs (as torchtitan's ``ModelWrapper``)."""

    def __init__(self, parts: list[torch.nn.Module]) -> None:
        super().__init__()
        self.parts = torch.nn.ModuleList(parts)

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:  # type: ignore[override]
        return {k: v for part in self.parts for k, v in part.state_dict().items()}

    def load_state_dict(self, state: Mapping[str, Any], strict: bool = True, assign: bool = False):  # type: ignore[override]
        for part in self.parts:
            own = part.state_dict()
            part.load_state_dict({k: v for k, v in state.items() if k in own}, strict=strict)


class FlashCheckpointManager:
    """torchtitan's checkpoint manager interface, backed by a :class:`flashckpt.Checkpointer`.

    Reads from torchtitan's checkpoint config (any object with these attributes): ``enable``,
    ``folder``, ``interval``, ``keep_latest_k``, ``load_step``, ``exclude_from_loading`` and
    ``async_mode`` (``"disabled"`` saves synchronously). ``memory_tier=`` (e.g.
    ``"/dev/shm/run"``) adds flashckpt's memory tier.
    """

    def __init__(
        self,
        config: Any,
        *,
        dataloader: Any,
        model_parts: list[torch.nn.Module],
        optimizers: Any,
        lr_schedulers: Any,
        states: dict[str, Any],
        sd_adapter: Any = None,
        base_folder: str = "",
        memory_tier: str | None = None,
    ) -> None:
        self.enable = bool(getattr(config, "enable", True))
        self.interval = int(getattr(config, "interval", 500))
        self.load_step = int(getattr(config, "load_step", -1))
        self.exclude = list(getattr(config, "exclude_from_loading", []) or [])
        self.folder = Path(base_folder) / getattr(config, "folder", "checkpoint")
        parts = list(model_parts)
        model: torch.nn.Module = parts[0] if len(parts) == 1 else ModelParts(parts)
        self.states: dict[str, Any] = {"model": model, "optimizer": optimizers}
        if lr_schedulers is not None:
            self.states["lr_scheduler"] = lr_schedulers
        if dataloader is not None:
            self.states["dataloader"] = BytesState(dataloader)  # its state is pickled bytes
        self.states.update(states)
        if not self.enable:
            self.ckpt = None
            return
        keep = int(getattr(config, "keep_latest_k", 10) or 0)
        self.ckpt = flashckpt.Checkpointer(
            self.folder,
            memory_tier=memory_tier,
            async_save=str(getattr(config, "async_mode", "async")).lower() != "disabled",
            incremental=True,
            keep=keep if keep > 0 else None,
        )

    def load(self, step: int = -1) -> bool:
        """Restore the newest step (or ``step``); False when there is none to load."""
        if self.ckpt is None:
            return False
        wanted = None if step == -1 else step
        state = {k: v for k, v in self.states.items() if k not in self.exclude}
        got = self.ckpt.restore(state, step=wanted)
        if got is None:
            return False
        log.info("flashckpt: restored step %d from %s", got, self.folder)
        return True

    def save(self, curr_step: int, last_step: bool = False) -> None:
        if self.ckpt is None or not (last_step or curr_step % self.interval == 0):
            return
        if self.ckpt.has_step(curr_step):
            return
        self.ckpt.save(curr_step, self.states)

    def maybe_wait_for_staging(self) -> None:
        """Nothing to wait for: flashckpt's optimizer pre-step hook waits for staging itself."""

    def close(self) -> None:
        if self.ckpt is not None:
            self.ckpt.close()
