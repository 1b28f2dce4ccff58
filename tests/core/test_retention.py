"""Retention policies and garbage collection."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import flashckpt
from flashckpt.policy import KeepEvery, KeepLast
from flashckpt.store.files.backend import LocalBackend
from flashckpt.store.gc import collect_garbage
from flashckpt.store.store import CheckpointStore


def _chunks(root: Path) -> set[str]:
    return {p.name for p in (root / "chunks").rglob("*") if p.is_file()}


def _save_series(root: Path, steps: list[int], **kw) -> dict[int, torch.Tensor]:
    values = {}
    with flashckpt.Checkpointer(root, **kw) as ckpt:
        for s in steps:
            values[s] = torch.full((1000,), float(s))
            ckpt.save(s, {"w": values[s]})
    return values


def test_keep_last(tmp_path):
    values = _save_series(tmp_path, [1, 2, 3, 4, 5], keep=KeepLast(2))
    with flashckpt.Checkpointer(tmp_path) as ckpt:
        assert ckpt.steps() == [4, 5]
        out = {"w": torch.zeros(1000)}
        ckpt.restore(out, step=4)
    assert torch.equal(out["w"], values[4])
    assert len(_chunks(tmp_path)) == 2  # chunks of deleted steps were collected


def test_keep_composed(tmp_path):
    _save_series(tmp_path, list(range(1, 11)), keep=KeepLast(2) | KeepEvery(4))
    with flashckpt.Checkpointer(tmp_path) as ckpt:
        assert ckpt.steps() == [4, 8, 9, 10]


def test_int_keep_means_keep_last(tmp_path):
    _save_series(tmp_path, [1, 2, 3], keep=1)
    with flashckpt.Checkpointer(tmp_path) as ckpt:
        assert ckpt.steps() == [3]


def test_gc_spares_pinned_and_referenced(tmp_path):
    _save_series(tmp_path, [1])
    store = CheckpointStore(LocalBackend(tmp_path))
    orphan = "f" * 32
    inflight = "e" * 32
    for h in (orphan, inflight):
        store.backend.put(f"chunks/{h[:2]}/{h}", [b"x"])
    live_before = _chunks(tmp_path) - {orphan, inflight}
    res = collect_garbage(store, pinned={inflight}, full=True)
    assert res.chunks_deleted == 1
    assert _chunks(tmp_path) == live_before | {inflight}


@pytest.mark.parametrize("bad", [0, -1, 1.5])
def test_bad_retention(bad):
    with pytest.raises(flashckpt.ConfigError):
        KeepLast(bad)
