"""Promotion from the pages a save just staged (engine/tiers/tiercopy.py ``Fresh``).

A chunk staged into a recycled file of the memory tier was hashed from its mapped pages; its
promotion to the disk writes those pages as they are instead of mapping the file again and
hashing it a second time. These tests check that it does, that the bytes on disk are right,
that the recycling pool never refills pages a promotion still holds, and that no page stays
mapped once the promotion ended, whichever way it ended.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import flashckpt
from flashckpt import Promotion
from flashckpt.engine.tiers import promote, tiercopy
from flashckpt.store.files.backend import LocalBackend
from flashckpt.store.store import STAGING_DIR, CheckpointStore

SIZE = 64 * 4096


def _state(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return {f"t{i}": torch.randn(1 << 20, generator=g) for i in range(4)}


def _mapped_chunks(tier: Path) -> list[str]:
    """The files under ``tier``'s chunk directories this process has mapped now."""
    with open("/proc/self/maps") as f:
        return [line.split()[-1] for line in f if f"{tier}/chunks/" in line]


def test_a_freshly_staged_step_is_promoted_from_the_pages_the_save_hashed(
    tmp_path: Path, shm_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    mapped: list[int] = []
    real_map = CheckpointStore.map_chunk

    def counted(self: CheckpointStore, *a: Any, **kw: Any) -> Any:
        mapped.append(1)
        return real_map(self, *a, **kw)

    monkeypatch.setattr(CheckpointStore, "map_chunk", counted)
    root = tmp_path / "ck"
    with flashckpt.Checkpointer(
        root, memory_tier=shm_dir, keep=2, keep_memory=2, async_save=True
    ) as ck:
        per_step = []
        for step in range(1, 7):
            before = len(mapped)
            ck.save(step, _state(step))
            ck.wait()
            assert ck.wait_promoted(60)
            per_step.append(len(mapped) - before)
    # the first saves write new files (nothing to recycle yet): mapped and verified to promote;
    # once retention freed files of their size, every chunk is staged into one and promoted
    # from the pages the save kept
    assert per_step[0] == 4 and per_step[-2:] == [0, 0], per_step
    for step in (5, 6):  # what reached the disk is what was saved
        got = {k: torch.empty_like(v) for k, v in _state(step).items()}
        assert flashckpt.restore(root, got, step=step) == step
        assert all(torch.equal(got[k], v) for k, v in _state(step).items())
    assert not _mapped_chunks(shm_dir)


def test_the_pool_never_refills_pages_a_promotion_still_holds(shm_dir: Path) -> None:
    """Retention may free a chunk whose pages a queued promotion holds (not through the
    engine, which pins them, but nothing else stops it): the pool must then not hand that
    file to the next staged chunk, or the promotion would write the new bytes under the old
    hash. The write lease refuses a file someone has open, and the kept mapping keeps it so."""
    backend = LocalBackend(str(shm_dir))
    backend.recycle_bytes = 1 << 30
    backend.put("chunks/ab/ab00", [os.urandom(SIZE)])
    assert backend.recycle("chunks/ab/ab00") == SIZE
    staged = backend.open_staged(STAGING_DIR, SIZE)
    assert staged.recycled
    staged.write(b"a" * SIZE)
    pages = staged.keep_pages()
    assert pages is not None
    staged.publish("chunks/cd/cd00")
    try:
        assert backend.recycle("chunks/cd/cd00") == SIZE  # freed while still held
        again = backend.open_staged(STAGING_DIR, SIZE)
        assert not again.recycled  # not the held file: a new one
        again.write(b"b" * SIZE)
        again.publish("chunks/ef/ef00")
        assert bytes(pages.buffer) == b"a" * SIZE
    finally:
        pages.close()
    assert not _mapped_chunks(shm_dir)


class _Held:
    """Holds every promotion's copy while closed (a slow disk); open at first."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.go = threading.Event()
        self.go.set()
        self.entered = threading.Event()
        real = promote.copy_step

        def held(*a: Any, **kw: Any) -> Any:
            self.entered.set()
            assert self.go.wait(60)
            return real(*a, **kw)

        monkeypatch.setattr(promote, "copy_step", held)


def _unmapped_soon(tier: Path) -> bool:
    """The promotion thread may still be ending a copy it was in: give it a moment."""
    deadline = time.monotonic() + 30
    while _mapped_chunks(tier) and time.monotonic() < deadline:
        time.sleep(0.01)
    return not _mapped_chunks(tier)


@pytest.mark.parametrize("ending", ["skipped", "not_due", "failed_copy", "closed_while_queued"])
def test_no_staged_page_stays_mapped_whichever_way_its_promotion_ends(
    tmp_path: Path, shm_dir: Path, monkeypatch: pytest.MonkeyPatch, ending: str
) -> None:
    opts: dict[str, Any] = {"backoff_s": 0.01, "max_backoff_s": 0.02}
    if ending == "skipped":
        opts.update(max_queued=1, on_full="skip")
    if ending == "not_due":
        opts.update(every=100)
    if ending == "failed_copy":
        opts.update(retries=2)

        def broken(*a: Any, **kw: Any) -> Any:
            raise OSError(5, "Input/output error (injected)")

        monkeypatch.setattr(tiercopy.ChunkCopier, "_copy_one", staticmethod(broken))
    if ending == "closed_while_queued":
        opts.update(max_queued=16, close_timeout_s=0.1, stop_timeout_s=0.1)
    held = _Held(monkeypatch)
    hold = ending in ("skipped", "closed_while_queued")
    kept: list[str] = []
    real_add = tiercopy.Fresh.add

    def add(self: tiercopy.Fresh, h: str, pages: Any) -> None:
        kept.append(h)
        real_add(self, h, pages)

    monkeypatch.setattr(tiercopy.Fresh, "add", add)
    ck = flashckpt.Checkpointer(
        tmp_path / "ck",
        memory_tier=shm_dir,
        keep=2,
        keep_memory=3,
        async_save=True,
        promotion=Promotion(**opts),
    )
    try:
        for step in range(1, 9):
            if step == 6:  # the pool holds freed files by now: the next saves keep pages
                ck.wait_promoted(60)
                del kept[:]
                if hold:  # a slow disk from here on
                    held.go.clear()
                    held.entered.clear()
            ck.save(step, _state(step))
            ck.wait()
            if step == 6 and hold:
                assert held.entered.wait(60)
        assert kept, "no save kept its pages: nothing was tested"
        if ending != "closed_while_queued":
            held.go.set()
            ck.wait_promoted(60)
            assert not _mapped_chunks(shm_dir)
    finally:
        ck.close()
        held.go.set()
    assert _unmapped_soon(shm_dir), _mapped_chunks(shm_dir)
