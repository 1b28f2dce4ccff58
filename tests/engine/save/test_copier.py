"""Staging copies split across threads while the loop waits for them (engine/save/copier.py)."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import flashckpt
from flashckpt.engine.save import copier as copier_mod
from flashckpt.engine.save.copier import PAGE, SPLIT_MIN, Copier, split

MiB = 1 << 20


@settings(max_examples=200, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 3 * PAGE + 17), min_size=1, max_size=12),
    n=st.integers(1, 5),
)
def test_split_parts_cover_the_pieces_in_order_at_page_boundaries(sizes, n) -> None:
    rng = np.random.default_rng(len(sizes) * 7 + n)
    views = [rng.integers(0, 255, s, dtype=np.uint8) for s in sizes]
    total = sum(sizes)
    buf = np.zeros(total, dtype=np.uint8)
    parts = split(buf, views, n)
    assert 1 <= len(parts) <= n if total else parts == []
    starts = [0]
    for dst, pieces in parts:
        assert dst.size == sum(p.size for p in pieces)
        copier_mod.copy_into(dst, pieces) if pieces else None
        starts.append(starts[-1] + dst.size)
    assert starts[-1] == total
    assert all(s % PAGE == 0 for s in starts[:-1])  # each part starts on a page boundary
    expected = np.concatenate(views) if views else buf
    assert np.array_equal(buf, expected)


def _views(total: int, pieces: int) -> list[np.ndarray]:
    rng = np.random.default_rng(total + pieces)
    cuts = sorted(rng.integers(0, total, pieces - 1)) if pieces > 1 else []
    data = rng.integers(0, 255, total, dtype=np.uint8)
    return np.split(data, cuts)


@pytest.mark.parametrize("pieces", [1, 5])
def test_a_waited_copy_is_split_across_the_helpers_and_a_background_one_is_not(pieces) -> None:
    waited, split_now = threading.Event(), threading.Event()
    seen: set[str] = set()
    real = copier_mod.copy_into
    together = threading.Barrier(3, timeout=10)  # the parts run at the same time

    def copy_into(buf, views):
        seen.add(threading.current_thread().name)
        if split_now.is_set():
            together.wait()
        real(buf, views)

    c = Copier(helpers=2, waited=waited.is_set)
    try:
        views = _views(4 * MiB + 123, pieces)
        buf = np.zeros(4 * MiB + 123, dtype=np.uint8)
        orig = copier_mod.copy_into
        copier_mod.copy_into = copy_into
        try:
            assert c.copy(buf, views) == 1  # nothing waits: the caller copies it whole
            assert seen == {threading.current_thread().name}
            buf[:] = 0
            seen.clear()
            waited.set()
            split_now.set()
            assert c.copy(buf, views) == 3  # the caller and both helpers, at the same time
            split_now.clear()
            assert len(seen) == 3 and any(n.startswith("flashckpt-copy") for n in seen)
            small = np.zeros(SPLIT_MIN - 1, dtype=np.uint8)
            assert c.copy(small, [np.ones(SPLIT_MIN - 1, dtype=np.uint8)]) == 1  # too small
        finally:
            copier_mod.copy_into = orig
        assert np.array_equal(buf, np.concatenate(views))
    finally:
        c.shutdown()


def test_a_failed_part_is_raised_after_every_part_ended() -> None:
    """The chunk's staging range is given back when the copy raises: no part may still be
    writing into it then."""
    ended: list[str] = []
    release = threading.Event()
    real = copier_mod.copy_into

    def copy_into(buf, views):
        if threading.current_thread().name.startswith("flashckpt-copy"):
            release.wait(10)  # the helper's part ends last
            ended.append("helper")
            real(buf, views)
            return
        release.set()
        raise OSError("the caller's part failed")

    c = Copier(helpers=1, waited=lambda: True)
    orig = copier_mod.copy_into
    copier_mod.copy_into = copy_into
    try:
        with pytest.raises(OSError, match="the caller's part failed"):
            c.copy(np.zeros(2 * MiB, dtype=np.uint8), [np.ones(2 * MiB, dtype=np.uint8)])
        assert ended == ["helper"]
    finally:
        copier_mod.copy_into = orig
        c.shutdown()


def test_a_copy_racing_shutdown_is_finished_by_the_caller() -> None:
    c = Copier(helpers=2, waited=lambda: True)
    c.shutdown()
    buf = np.zeros(3 * MiB, dtype=np.uint8)
    views = _views(3 * MiB, 3)
    c.copy(buf, views)
    assert np.array_equal(buf, np.concatenate(views))


def test_no_helpers_on_one_core(monkeypatch) -> None:
    monkeypatch.setattr(copier_mod.os, "sched_getaffinity", lambda pid: {0})
    assert copier_mod.copy_helpers() == 0
    monkeypatch.setattr(copier_mod.os, "sched_getaffinity", lambda pid: set(range(64)))
    assert copier_mod.copy_helpers() == copier_mod.MAX_HELPERS


@pytest.mark.parametrize("waiter", ["save without an optimizer", "optimizer hook"])
def test_a_save_the_loop_waits_for_splits_its_copies_and_restores_bitwise(
    tmp_path, monkeypatch, waiter
) -> None:
    """Through the public API: the copies the loop waits for are split (each part on its own
    thread), the checkpoint restores bit for bit, and the helpers are save threads (the
    governor's levels move them)."""
    parts: list[int] = []
    real = Copier.copy

    def copy(self, buf, views):
        n = real(self, buf, views)
        parts.append(n)
        return n

    monkeypatch.setattr(Copier, "copy", copy)
    monkeypatch.setattr(copier_mod, "copy_helpers", lambda: 2)
    from flashckpt.engine.runtime import saving

    monkeypatch.setattr(saving, "copy_helpers", lambda: 2)
    g = torch.Generator().manual_seed(3)
    model = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(3)])
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, 512, generator=g)).sum().backward()
    opt.step()
    state = {"model": model, "opt": opt}
    expected = {k: v.clone() for k, v in model.state_dict().items()}  # what the save holds
    with flashckpt.Checkpointer(tmp_path, async_save=True, fsync=False, chunk_size="4MiB") as ck:
        assert ck._saver.copier.helpers == 2 and not ck._saver.pool._fault_in
        if waiter == "save without an optimizer":
            handle = ck.save(1, {"model": model})  # returns once staged: waited for
        else:
            handle = ck.save(1, state)
            opt.step()  # the pre-step hook waits for staging
        handle.wait()
        assert max(parts) == 3, parts
        helpers = [t for t in threading.enumerate() if t.name.startswith("flashckpt-copy")]
        assert helpers and {t.native_id for t in helpers} <= set(ck._saver.priority.threads)
    for p in model.parameters():
        p.data.zero_()
    assert flashckpt.restore(tmp_path, {"model": model}) == 1
    assert all(torch.equal(model.state_dict()[k], v) for k, v in expected.items())
