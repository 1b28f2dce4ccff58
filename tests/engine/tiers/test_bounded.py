"""Bounded tiers: the promotion queue, close() order, failed promotions leave no orphans."""

from __future__ import annotations

import errno
import json
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

import flashckpt
from flashckpt.engine.tiers import tiercopy
from flashckpt.engine.tiers import tierset as tiers
from flashckpt.engine.tiers.promote import Promotion
from flashckpt.errors import ConfigError
from flashckpt.journal import read_events
from flashckpt.store.files.backend import LocalBackend


def _state(step: int) -> dict[str, Any]:
    # three tensors above the packing threshold: three chunks per step
    return {f"t{i}": torch.full((400, 400), float(step * 10 + i)) for i in range(3)}


def _referenced(d: Path) -> set[str]:
    refs: set[str] = set()
    for p in (d / "steps").glob("*.json"):
        refs |= {c[0] for c in json.loads(p.read_text())["chunks"]}
    return refs


def _chunk_files(d: Path) -> set[str]:
    return {p.name.split(".")[0] for p in (d / "chunks").rglob("*") if p.is_file()}


def _steps(d: Path) -> list[int]:
    return sorted(int(p.name[:12]) for p in (d / "steps").glob("*.json") if "rank" not in p.name)


class _Gate:
    """Blocks every chunk copy of a promotion until opened (a slow disk)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.open = threading.Event()
        self.entered = threading.Event()  # a promotion is copying (and held)
        real = tiercopy.ChunkCopier._copy_one

        def slow(*args):
            self.entered.set()
            self.open.wait(60)
            return real(*args)

        monkeypatch.setattr(tiercopy.ChunkCopier, "_copy_one", staticmethod(slow))


def test_promotion_queue_is_bounded_and_skips_intermediate_steps(tmp_path, shm_dir, monkeypatch):
    """The queue was unbounded and every queued step pinned its chunks: the memory tier grew to
    2.8 GB against keep_memory=2 when promotion fell behind."""
    gate = _Gate(monkeypatch)
    opts = Promotion(max_queued=1, on_full="skip", backoff_s=0.01, max_backoff_s=0.02)
    root = tmp_path / "ck"
    with flashckpt.Checkpointer(root, memory_tier=shm_dir, keep_memory=2, promotion=opts) as ck:
        for step in range(1, 9):
            ck.save(step, _state(step))
            if step == 1:  # step 1 is being copied before the next ones queue: on a loaded
                assert gate.entered.wait(60)  # host the promoter may not have picked it up yet
            assert len(ck._tiers.promoter.pending()) <= 1
            # retention plus the step being copied and the one waiting: never more
            assert len(_chunk_files(shm_dir)) <= 3 * (2 + 2)
        gate.open.set()
        ck.wait_promoted(60)
    skipped = [e["step"] for e in read_events(root) if e["event"] == "promote_skipped"]
    assert skipped and all(1 < s < 8 for s in skipped)
    # a skipped step the memory tier still holds at close (keep_memory=2: step 7) is promoted
    # by close (engine/tiers/closing.py: nothing stays in memory only); the others never are
    assert 8 in _steps(root) and not (set(skipped) - {7}) & set(_steps(root))
    assert _chunk_files(shm_dir) == _referenced(shm_dir)


def test_full_queue_makes_the_next_save_wait_by_default(tmp_path, shm_dir):
    root = tmp_path / "ck"
    with flashckpt.Checkpointer(
        root, memory_tier=shm_dir, keep_memory=1, promotion=Promotion(max_queued=1)
    ) as ck:
        for step in range(1, 6):
            ck.save(step, _state(step))
            assert len(ck._tiers.promoter.pending()) <= 1
    assert _steps(root) == [1, 2, 3, 4, 5]  # nothing skipped


def test_close_stops_the_promoter_before_releasing_tier_locks(tmp_path, shm_dir, monkeypatch):
    """Promoter.stop joined with a 5 s timeout and the locks were released while it wrote."""
    gate = _Gate(monkeypatch)
    alive_at_release: list[bool] = []
    real_release = tiers.release_locks

    def watching(ts):
        # this Checkpointer's promoter (another test of the worker may have left a stuck one)
        thread = ck._tiers.promoter._thread
        alive_at_release.append(thread is not None and thread.is_alive())
        return real_release(ts)

    monkeypatch.setattr(tiers, "release_locks", watching)
    timer = threading.Timer(6.0, gate.open.set)  # longer than the old 5 s join
    ck = flashckpt.Checkpointer(
        tmp_path / "ck", memory_tier=shm_dir, promotion=Promotion(close_timeout_s=0)
    )
    ck.save(1, _state(1))
    timer.start()
    try:
        ck.close()
    finally:
        timer.cancel()
        gate.open.set()
    assert alive_at_release == [False]


def test_close_leaves_the_memory_tier_within_its_retention(tmp_path, shm_dir, monkeypatch):
    gate = _Gate(monkeypatch)
    opts = Promotion(max_queued=1, on_full="skip", close_timeout_s=0)
    ck = flashckpt.Checkpointer(tmp_path / "ck", memory_tier=shm_dir, keep_memory=2, promotion=opts)
    for step in range(1, 7):
        ck.save(step, _state(step))
    threading.Timer(0.5, gate.open.set).start()
    ck.close()
    assert len(_steps(shm_dir)) <= 2
    assert _chunk_files(shm_dir) == _referenced(shm_dir)  # no pinned garbage left in RAM


def test_failed_promotion_leaves_no_orphan_chunks(tmp_path, shm_dir, monkeypatch):
    """A promotion that failed with ENOSPC left the chunks it had copied behind."""
    root = (tmp_path / "ck").absolute()
    real_put = LocalBackend.put
    calls = {"n": 0}

    def full_disk(self, path, parts):
        if self.root == root and path.startswith("chunks/"):
            calls["n"] += 1
            if calls["n"] >= 2:
                raise OSError(errno.ENOSPC, "No space left on device")
        return real_put(self, path, parts)

    monkeypatch.setattr(LocalBackend, "put", full_disk)
    opts = Promotion(retries=1, workers=1)
    with flashckpt.Checkpointer(
        root, memory_tier=shm_dir, promotion=opts, chunk_size="256KiB"
    ) as ck:
        ck.save(1, _state(1))
        ck.wait_promoted(60)
    assert _steps(root) == []
    assert calls["n"] >= 2
    assert _chunk_files(root) == set()
    assert [e for e in read_events(root) if e["event"] == "promote_abandoned"]


@pytest.mark.parametrize("bad", [{"max_queued": 0}, {"on_full": "drop"}, {"stop_timeout_s": -1}])
def test_bad_promotion_options(bad):
    with pytest.raises(ConfigError):
        Promotion(**bad)
