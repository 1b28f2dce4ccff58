"""Helpers shared by the hostile-input tests."""

from __future__ import annotations

from pathlib import Path

import torch

import flashckpt


def small_state(value: float = 0.0) -> dict[str, object]:
    return {"w": torch.full((64,), value), "meta": {"lr": 0.1}}


def restore_newest(root: Path) -> int | None:
    state = small_state()
    with flashckpt.Checkpointer(root) as ckpt:
        step = ckpt.restore(state)
    if step is not None:
        assert torch.equal(state["w"], torch.full((64,), float(step)))  # type: ignore[arg-type]
    return step


def manifest_path(root: Path, step: int) -> Path:
    return root / "steps" / f"{step:012d}.json"
