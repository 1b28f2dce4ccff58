"""A clean close() empties the memory tier when every step in it is also in a slower tier;
each rule that keeps it has a test (engine/tiers/closing.py)."""

from __future__ import annotations

import signal
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

import flashckpt
from flashckpt.engine.tiers import promote
from flashckpt.engine.tiers.promote import Promotion
from flashckpt.journal import read_events
from flashckpt.store.files.backend import LocalBackend
from flashckpt.store.store import CheckpointStore


def _ckpt(tmp_path: Path, **kw: Any) -> flashckpt.Checkpointer:
    return flashckpt.Checkpointer(tmp_path / "root", memory_tier=tmp_path / "shm", **kw)


def _state(v: float) -> dict[str, Any]:
    return {"w": torch.full((1024,), v)}


def _memory_steps(tmp_path: Path) -> list[int]:
    return CheckpointStore(LocalBackend(tmp_path / "shm")).steps()


def _chunk_files(tmp_path: Path) -> list[Path]:
    return [p for p in (tmp_path / "shm" / "chunks").rglob("*") if p.is_file()]


def _events(tmp_path: Path, name: str) -> list[dict[str, Any]]:
    return [e for e in read_events(tmp_path / "root") if e["event"] == name]


def test_clean_close_empties_memory_tier_once_all_steps_are_on_disk(tmp_path: Path) -> None:
    ck = _ckpt(tmp_path, keep_memory=2, keep=3)
    for step in (1, 2):
        ck.save(step, _state(step))
    assert _memory_steps(tmp_path) == [1, 2] and _chunk_files(tmp_path)
    ck.close()
    assert _memory_steps(tmp_path) == [] and _chunk_files(tmp_path) == []
    (ev,) = _events(tmp_path, "memory_emptied")
    assert ev["steps_deleted"] == [1, 2] and ev["bytes_deleted"] > 0
    out = _state(0)
    with _ckpt(tmp_path) as again:
        assert again.restore(out) == 2  # from the local tier
    assert torch.equal(out["w"], _state(2)["w"])


def test_keep_memory_after_close_opts_out(tmp_path: Path) -> None:
    with _ckpt(tmp_path, keep_memory_after_close=True) as ck:
        ck.save(1, _state(1))
    assert _memory_steps(tmp_path) == [1]
    assert not _events(tmp_path, "memory_emptied")


def test_memory_step_missing_from_slower_tiers_keeps_the_memory_tier(tmp_path: Path) -> None:
    """local keeps 1, memory keeps 2: step 1 exists only in memory, so nothing is deleted."""
    with _ckpt(tmp_path, keep_memory=2, keep=1) as ck:
        ck.save(1, _state(1))
        ck.save(2, _state(2))
    assert _memory_steps(tmp_path) == [1, 2]
    (ev,) = _events(tmp_path, "memory_kept")
    assert ev["steps"] == [1] and "not committed in a slower tier" in ev["reason"]


def test_unfinished_promotion_keeps_the_memory_tier(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    started = threading.Event()

    def stuck_copy(src: Any, dst: Any, manifest: Any, copier: Any, *, stop: Any, **kw: Any) -> Any:
        started.set()
        while not stop():
            started.wait(0.01)
        raise promote.PromotionStopped()

    monkeypatch.setattr(promote, "copy_step", stuck_copy)
    ck = _ckpt(tmp_path, promotion=Promotion(close_timeout_s=0.2, stop_timeout_s=10))
    ck.save(1, _state(1))
    assert started.wait(30)
    ck.close()
    assert _memory_steps(tmp_path) == [1]
    (ev,) = _events(tmp_path, "memory_kept")
    assert "did not finish" in ev["reason"]


def test_preempted_close_keeps_the_memory_tier(tmp_path: Path) -> None:
    ck = _ckpt(tmp_path, handle_sigterm=True, grace_period_s=20)
    ck.save(1, _state(1))
    assert ck.wait_promoted(30)  # the step is on disk too: only SIGTERM keeps it
    assert ck._preempt is not None
    ck._preempt._on_signal(signal.SIGTERM, None)
    ck.close()
    assert _memory_steps(tmp_path) == [1]
    assert not _events(tmp_path, "memory_emptied")


def test_clean_close_after_dropped_promotions_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Regression: promotions dropped by ``on_full="skip"`` (a slow disk) left their steps only
    in the memory tier, so the clean close kept the memory tier and its chunks for good. At
    close the steps a slower tier's retention wants are promoted, then the tier is emptied."""
    real = promote.copy_step
    gate = threading.Event()

    def slow_copy(*a: Any, **kw: Any) -> Any:
        gate.wait(30)  # held until every save is queued: the queue overflows
        return real(*a, **kw)

    monkeypatch.setattr(promote, "copy_step", slow_copy)
    ck = _ckpt(tmp_path, keep_memory=3, keep=3, promotion=Promotion(max_queued=1, on_full="skip"))
    for step in range(1, 6):
        ck.save(step, _state(step))
    gate.set()
    assert _events(tmp_path, "promote_skipped"), "no promotion was dropped"
    ck.close()
    assert _memory_steps(tmp_path) == [] and _chunk_files(tmp_path) == []
    assert not _events(tmp_path, "memory_kept")
    disk = CheckpointStore(LocalBackend(tmp_path / "root")).steps()
    assert disk == [3, 4, 5]
    out = _state(0)
    with _ckpt(tmp_path) as again:
        assert again.restore(out) == 5
    assert torch.equal(out["w"], _state(5)["w"])


def test_clean_close_leaves_no_chunk_of_the_last_save(tmp_path: Path) -> None:
    """Regression: the last save's job kept pinning its chunks after it was committed, so the
    clean close deleted the memory tier's steps but left the last step's chunks."""
    ck = _ckpt(tmp_path, compression="zstd", async_save=True)
    ck.save(1, _state(1))
    ck.save(2, _state(2))
    ck.close()
    assert _memory_steps(tmp_path) == [] and _chunk_files(tmp_path) == []
    (ev,) = _events(tmp_path, "memory_emptied")
    assert ev["bytes_deleted"] > 0
