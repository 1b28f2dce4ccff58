"""Opening a checkpoint root the way every read-only command does, and picking its step."""

from __future__ import annotations

from pathlib import Path

from flashckpt.errors import ConfigError, NoCheckpointError
from flashckpt.store.files.backend import LocalBackend
from flashckpt.store.store import CheckpointStore


def open_store(root: str) -> CheckpointStore:
    p = Path(root).expanduser()
    if not (p / "steps").is_dir():
        raise ConfigError(f"{root} is not a flashckpt checkpoint root (no steps/ directory)")
    return CheckpointStore(LocalBackend(p, create=False))


def pick_step(store: CheckpointStore, step: int | None) -> int:
    steps = store.steps()
    if not steps:
        raise NoCheckpointError(f"{store.url} holds no checkpoint")
    if step is None:
        return steps[-1]
    if step not in steps:
        raise NoCheckpointError(f"step {step} is not in {store.url}; steps: {steps}")
    return step
