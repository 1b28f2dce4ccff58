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


def sharded_form(doc: dict, version: int | None = None) -> dict:
    """``doc`` (a parsed manifest) with every compact entry (format version 2: ``"extents"``,
    the whole tensor) written out as version 1 wrote it, one shard at the origin: the hostile
    tests mutate both layouts. ``version``: also set the manifest's format version."""
    for entry in doc["tensors"].values():
        if "extents" in entry:
            nd = len(entry["global_shape"])
            entry["shards"] = [
                {
                    "offset": [0] * nd,
                    "shape": list(entry["global_shape"]),
                    "rank": 0,
                    "extents": entry.pop("extents"),
                }
            ]
    if version is not None:
        doc["version"] = version
    return doc
