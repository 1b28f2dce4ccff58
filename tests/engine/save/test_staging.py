"""The staging pool: page-aligned ranges sized to each chunk, bounded, reused, never leaked."""

from __future__ import annotations

import itertools
import threading

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_async import SlowBackend

import flashckpt
from flashckpt.engine.save.staging import StagingPool
from flashckpt.store.files.directio import ALIGN, aligned

MiB = 1 << 20


def _pool(budget=4 * MiB, chunk=MiB, needed=4 * MiB) -> StagingPool:
    pool = StagingPool(budget_bytes=budget, chunk_bytes=chunk)
    pool.reserve(needed_bytes=needed, pin=False)
    return pool


def test_ranges_are_page_aligned_sized_to_the_chunk_and_disjoint():
    pool = _pool()
    sizes = [5, ALIGN, ALIGN + 1, 300_000, MiB]
    starts = [pool.acquire(n) for n in sizes]
    assert all(s % ALIGN == 0 for s in starts)
    assert all(pool.view(s, 1).data_ptr() % ALIGN == 0 for s in starts)
    spans = sorted((s, s + aligned(n)) for s, n in zip(starts, sizes, strict=True))
    assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans)), spans
    # a small chunk costs what it holds: the 5 small ranges together are well under 2 MiB
    assert sum(aligned(n) for n in sizes) < 2 * MiB


def test_full_pool_says_so_and_a_release_merges_space_back():
    pool = _pool(budget=2 * MiB, chunk=MiB, needed=2 * MiB)
    a, b = pool.acquire(MiB), pool.acquire(MiB)
    assert pool.try_acquire(1) is None
    pool.release(a)
    pool.release(b)
    # both halves merged: a range of the whole arena fits again
    whole = pool.try_acquire(2 * MiB)
    assert whole == 0


def test_acquire_waits_for_a_release():
    pool = _pool(budget=MiB, chunk=MiB, needed=MiB)
    first = pool.acquire(MiB)
    got: list[int] = []
    waiter = threading.Thread(target=lambda: got.append(pool.acquire(MiB)))
    waiter.start()
    waiter.join(0.2)
    assert waiter.is_alive() and not got, "no space: the second acquire must wait"
    pool.release(first)
    waiter.join(10)
    assert got == [first]


def test_arena_holds_at_least_one_chunk_and_at_most_the_budget():
    assert _pool(budget=8 * MiB, chunk=MiB, needed=10).capacity_bytes == MiB
    assert _pool(budget=3 * MiB, chunk=MiB, needed=100 * MiB).capacity_bytes == 3 * MiB
    with pytest.raises(RuntimeError, match="does not fit"):
        _pool(budget=MiB, chunk=MiB, needed=MiB).acquire(2 * MiB)


def test_pinned_arena_is_what_the_save_needs_and_allocated_once():
    """The arena is exactly the save's need within the budget (no power-of-two rounding: it is
    page-locked with cudaHostRegister, not torch's pinned allocator). Where pinning is
    unavailable (CPU-only torch) the same sizes are used, pageable, and pinning is not retried
    on every save."""
    pool = StagingPool(budget_bytes=64 * MiB, chunk_bytes=MiB)
    pool.reserve(needed_bytes=5 * MiB, pin=True)
    assert pool.capacity_bytes == 5 * MiB
    first = pool.view(0, 1).data_ptr()
    pool.reserve(needed_bytes=4 * MiB, pin=True)
    assert pool.view(0, 1).data_ptr() == first, "no new arena for a save that fits"
    assert pool.pinned == torch.cuda.is_available()
    tight = StagingPool(budget_bytes=48 * MiB, chunk_bytes=MiB)
    tight.reserve(needed_bytes=60 * MiB, pin=True)
    assert tight.capacity_bytes == 48 * MiB
    assert tight.view(0, 1).data_ptr() % ALIGN == 0


def test_arena_is_not_resized_under_staged_chunks():
    pool = _pool(budget=8 * MiB, chunk=MiB, needed=MiB)
    pool.acquire(MiB)
    with pytest.raises(RuntimeError, match="while chunks are staged"):
        pool.reserve(needed_bytes=4 * MiB, pin=False)


class CountingGate(SlowBackend):
    """Chunk writes are held by the gate; counts the writes that have finished."""

    def __init__(self, root, gate):
        super().__init__(root, gate=gate)
        self.finished = 0

    def put(self, path, parts):
        n = super().put(path, parts)
        if path.startswith("chunks/"):
            self.finished += 1
        return n


def test_many_small_tensors_stage_in_one_pass_while_writes_are_held(tmp_path):
    """Twenty 1.5 MiB tensors (too big to pack) with 4 MiB chunks: each chunk takes a range of
    its own size, so staging completes before a single chunk has been written (with one 4 MiB
    slot per chunk and an arena sized to the state, it had to wait for writes to free slots)."""
    state = {f"t{i}": torch.full((384 * 1024,), float(i)) for i in range(20)}
    gate = threading.Event()
    with flashckpt.Checkpointer(
        tmp_path, async_save=True, chunk_size="4MiB", host_memory_budget="64MiB"
    ) as ck:
        backend = CountingGate(tmp_path, gate)
        ck.store.backend = backend
        try:
            handle = ck.save(1, state)  # no optimizer in the state: returns when staged
            assert handle.staged.done()
            assert backend.finished == 0, "staging waited for chunk writes"
            assert ck._pool.capacity_bytes < 40 * MiB  # 30 MiB staged, not 20 x 4 MiB
        finally:
            gate.set()
        handle.wait(timeout=60)
    out = {k: torch.zeros_like(v) for k, v in state.items()}
    with flashckpt.Checkpointer(tmp_path) as ck:
        ck.restore(out)
    assert all(torch.equal(out[k], state[k]) for k in state)


def test_a_failed_copy_gives_its_range_back(tmp_path, monkeypatch):
    import numpy as np

    from flashckpt.engine.save import job as save_mod

    state = {"t": torch.randn(1 << 18)}
    with flashckpt.Checkpointer(tmp_path, async_save=True, chunk_size="256KiB") as ck:
        real = save_mod.np.copyto
        calls = {"n": 0}

        def broken(dst, src):
            calls["n"] += 1
            if calls["n"] == 2:
                raise MemoryError("injected copy failure")
            return real(dst, src)

        monkeypatch.setattr(save_mod.np, "copyto", broken)
        with pytest.raises(flashckpt.SaveError, match="injected copy failure"):
            ck.save(1, state).wait(timeout=60)
        monkeypatch.setattr(save_mod.np, "copyto", np.copyto)
        assert ck._pool._taken == {}, "every range came back"
        with torch.no_grad():
            state["t"].add_(1)
        ck.save(2, state).wait(timeout=60)  # the pool is whole: the next save works
    out = {"t": torch.zeros(1 << 18)}
    with flashckpt.Checkpointer(tmp_path) as ck:
        assert ck.restore(out) == 2
    assert torch.equal(out["t"], state["t"])


@settings(max_examples=150, deadline=None)
@given(
    st.lists(
        st.one_of(
            st.tuples(st.just("take"), st.integers(1, 3 * MiB)),
            st.tuples(st.just("give"), st.integers(0, 50)),
        ),
        max_size=60,
    )
)
def test_ranges_never_overlap_and_all_space_comes_back(ops):
    """Any sequence of takes and gives: taken ranges are aligned, disjoint and inside the
    arena; the free list never overlaps a taken range; when all are given back the arena is
    one free range again."""
    pool = _pool(budget=8 * MiB, chunk=4 * MiB, needed=8 * MiB)
    cap = pool.capacity_bytes
    held: list[tuple[int, int]] = []
    for op, arg in ops:
        if op == "take":
            start = pool.try_acquire(arg)
            if start is not None:
                held.append((start, start + aligned(arg)))
        elif held:
            start, _ = held.pop(arg % len(held))
            pool.release(start)
        spans = sorted(held + pool._free)
        assert all(s % ALIGN == 0 and 0 <= s < e <= cap for s, e in spans)
        assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans)), spans
        assert sum(e - s for s, e in spans) == cap  # nothing lost, nothing counted twice
    for start, _ in held:
        pool.release(start)
    assert pool._free == [(0, cap)]


# -- the warm-up: the arena (and threads, directories) ready before the first save ------------
def _seed_checkpoint(root, state, **kw) -> None:
    with flashckpt.Checkpointer(root, async_save=True, chunk_size="1MiB", **kw) as ck:
        ck.save(1, state).wait(timeout=60)


def _wait_warm(ck) -> None:
    assert ck._warmup.done.wait(60), "the warm-up did not finish"


def _big_state(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {f"w{i}": torch.randn(MiB // 4, generator=g) for i in range(6)}  # 6 MiB


def test_warmup_touches_an_arena_sized_like_the_newest_checkpoint(tmp_path):
    """Regression: a restarted Checkpointer's first async save faulted in a fresh arena page
    by page while the caller waited (3.2-3.6 s for 1.2 GB here, 0.5 s warm). The warm-up now
    reserves and touches it in the background, sized like the newest checkpoint; the first
    save stages into that same memory and round-trips bitwise."""
    state = _big_state()
    _seed_checkpoint(tmp_path, state)
    with flashckpt.Checkpointer(tmp_path, async_save=True, chunk_size="1MiB") as ck:
        _wait_warm(ck)
        pool = ck._pool
        assert pool.capacity_bytes >= 6 * MiB and pool.touched_bytes == pool.capacity_bytes
        assert ck._warmup.staged_bytes == pool.capacity_bytes
        before = pool.view(0, 1).data_ptr()
        with torch.no_grad():
            for v in state.values():
                v.add_(1)
        ck.save(2, state).wait(timeout=60)
        assert pool.view(0, 1).data_ptr() == before, "the first save allocated a new arena"
    out = {k: torch.zeros_like(v) for k, v in state.items()}
    assert flashckpt.restore(tmp_path, out) == 2
    assert all(torch.equal(out[k], state[k]) for k in state)


def test_warmup_respects_the_host_memory_budget(tmp_path):
    _seed_checkpoint(tmp_path, _big_state())
    with flashckpt.Checkpointer(
        tmp_path, async_save=True, chunk_size="1MiB", host_memory_budget="2MiB"
    ) as ck:
        _wait_warm(ck)
        assert ck._pool.capacity_bytes == 2 * MiB


def test_no_warm_arena_for_a_fresh_root_or_a_sync_cpu_checkpointer(tmp_path):
    with flashckpt.Checkpointer(tmp_path / "fresh", async_save=True) as ck:
        _wait_warm(ck)
        assert ck._pool.capacity_bytes == 0  # nothing says how big the first save is
    _seed_checkpoint(tmp_path / "seeded", _big_state())
    with flashckpt.Checkpointer(tmp_path / "seeded") as ck:  # sync CPU saves never stage
        _wait_warm(ck)
        assert ck._pool.capacity_bytes == 0


def test_warmup_lists_the_stored_chunks_and_starts_the_threads(tmp_path):
    """Regression: a tier's first save listed every chunk directory (its chunk index) before
    its first write, and started each worker thread as it went; the warm-up does both at
    start, and the first save after the restart's restore still reuses what the index holds
    (a chunk is reused once this process verified it: the restore did, store/liveness.py;
    without the restore the outcome hung on whether the idle scrub had verified them yet)."""
    state = _big_state()
    with flashckpt.Checkpointer(tmp_path, chunk_size="1MiB") as ck:
        ck.save(1, state)
    with flashckpt.Checkpointer(tmp_path, chunk_size="1MiB") as ck:
        assert ck.restore(state) == 1
        _wait_warm(ck)
        assert ck.store.liveness._index is not None, "the chunk index was not built"
        assert len(ck.store.liveness._index) == 6
        assert (tmp_path / "steps").is_dir() and (tmp_path / "chunks").is_dir()
        names = {t.name for t in threading.enumerate()}
        assert sum(n.startswith("flashckpt-persist") for n in names) == ck._workers._max_workers
        assert any(n.startswith("flashckpt-stage") for n in names)
        stats = ck.save(2, state).durable.result(timeout=60)
    assert stats.chunks_new == 0 and stats.chunks_reused == 6


def test_a_first_save_racing_the_warmup_works(tmp_path, monkeypatch):
    """The save arrives while the warm-up is touching the arena (held back here until the
    save has started): it waits for the rest of the touching, never deadlocks, and its bytes
    are right; the warm-up never writes into ranges a save holds."""
    from flashckpt.engine.save import staging

    state = _big_state()
    _seed_checkpoint(tmp_path, state)
    started, go = threading.Event(), threading.Event()
    real_warm = staging.StagingPool.warm

    def held_warm(self, **kw):
        started.set()
        go.wait(30)
        return real_warm(self, **kw)

    monkeypatch.setattr(staging, "TOUCH_PIECE", 64 * 1024)  # many pieces: a long touch
    monkeypatch.setattr(staging.StagingPool, "warm", held_warm)
    with flashckpt.Checkpointer(tmp_path, async_save=True, chunk_size="1MiB") as ck:
        assert started.wait(30)
        with torch.no_grad():
            for v in state.values():
                v.mul_(3)
        racer = threading.Thread(target=lambda: ck.save(2, state).wait(timeout=60))
        racer.start()
        go.set()
        racer.join(60)
        assert not racer.is_alive(), "the first save deadlocked with the warm-up"
        _wait_warm(ck)
        assert ck._pool._taken == {}
    out = {k: torch.zeros_like(v) for k, v in state.items()}
    assert flashckpt.restore(tmp_path, out) == 2
    assert all(torch.equal(out[k], state[k]) for k in state)


def test_close_during_the_warmup_stops_it_and_gives_the_arena_back(tmp_path, monkeypatch):
    """close() while the arena is being touched: the warm-up stops between pieces, its thread
    ends, and the arena is released (never kept by a closed Checkpointer)."""
    from flashckpt.engine.save import staging

    _seed_checkpoint(tmp_path, _big_state())
    touching = threading.Event()
    real_warm = staging.StagingPool.warm

    def stalled_warm(self, *, stop, **kw):
        class Stalls:  # the touch loop polls it between pieces: stall there until close
            def is_set(self) -> bool:
                touching.set()
                stop.wait(30)
                return stop.is_set()

        return real_warm(self, stop=Stalls(), **kw)

    monkeypatch.setattr(staging.StagingPool, "warm", stalled_warm)
    ck = flashckpt.Checkpointer(tmp_path, async_save=True, chunk_size="1MiB")
    assert touching.wait(30)
    assert ck._pool.capacity_bytes > 0 and ck._pool.touched_bytes < ck._pool.capacity_bytes
    ck.close()
    assert not ck._warmup._thread.is_alive()
    assert ck._pool.capacity_bytes == 0, "close kept the staging arena"


def test_pool_warm_does_nothing_while_chunks_are_staged():
    pool = _pool(budget=8 * MiB, chunk=MiB, needed=MiB)
    start = pool.acquire(MiB)
    pool.view(start, MiB).fill_(7)
    pool.warm(needed_bytes=4 * MiB, pin=False, stop=threading.Event())
    assert pool.capacity_bytes == MiB, "warm() resized the arena under a staged chunk"
    assert bool((pool.view(start, MiB) == 7).all()), "warm() wrote into a staged range"


@pytest.mark.parametrize("context", [True, False])
def test_warmup_pins_only_where_a_cuda_context_exists(tmp_path, monkeypatch, context):
    """With CUDA usable (the asynchronous stand-in: every tensor counts as a cuda:1 tensor) a
    synchronous Checkpointer warms a pinned arena when the process has a CUDA context already,
    and the device-path first save stages into that arena. Without a context the warm-up pins
    nothing (it would make a context on GPU 0 in every rank); the first save pins, under the
    state's device (issue 29, defect 4)."""
    from fake_device import FakeDevice

    state = _big_state()
    _seed_checkpoint(tmp_path, state)
    fake = FakeDevice(delay_s=0.0, default_device="cuda:1").install(monkeypatch)
    if context:
        fake.on(torch.zeros(1), "cuda:1")  # the model is on its device: a context on 1
    try:
        with flashckpt.Checkpointer(tmp_path, chunk_size="1MiB") as ck:
            _wait_warm(ck)
            assert fake.contexts == ({1} if context else set()), "the warm-up made a context"
            assert len(fake.pin_threads) == int(context)
            if context:
                assert ck._pool.pinned and ck._pool.capacity_bytes >= 6 * MiB
                first = ck._pool.view(0, 1).data_ptr()
            with torch.no_grad():
                for v in state.values():
                    v.sub_(2)
            ck.save(2, state)
            assert ck._pool.pinned and len(fake.pin_threads) == 1, "pinned once"
            if context:
                assert ck._pool.view(0, 1).data_ptr() == first
            assert fake.contexts == {1}, "a context on a device the state is not on"
        assert fake.streams_created == {1: 1}, "the save took the device path"
        out = {k: torch.zeros_like(v) for k, v in state.items()}
        assert flashckpt.restore(tmp_path, out) == 2
        assert all(torch.equal(out[k], state[k]) for k in state)
    finally:
        fake.close()


def test_an_arena_reserved_by_a_save_is_populated_and_page_aligned():
    """reserve() is the save path (a fresh root: nothing sized the arena before): the kernel
    faults the arena in as it maps it, so the first copy into it takes no page faults."""
    pool = _pool(budget=8 * MiB, chunk=MiB, needed=5 * MiB)
    assert pool.capacity_bytes == 5 * MiB and pool.touched_bytes == pool.capacity_bytes
    assert pool.view(0, 1).data_ptr() % ALIGN == 0
    pool.view(0, 5 * MiB).fill_(3)
    assert int(pool.view(5 * MiB - 1, 1)) == 3


@pytest.mark.parametrize("kernel_populates", [True, False])
def test_warm_faults_every_piece_in_with_or_without_madvise(monkeypatch, kernel_populates):
    """warm() asks the kernel to populate each piece (MADV_POPULATE_WRITE) and touches the
    pages itself where the kernel cannot; either way the whole arena ends up resident."""
    from flashckpt.engine.save import staging

    asked: list[tuple[int, int]] = []
    real = staging._populate

    def populate(buf, start, length):
        asked.append((start, length))
        return real(buf, start, length) if kernel_populates else False

    monkeypatch.setattr(staging, "TOUCH_PIECE", 2 * MiB)
    monkeypatch.setattr(staging, "_populate", populate)
    pool = StagingPool(budget_bytes=16 * MiB, chunk_bytes=MiB)
    pool.warm(needed_bytes=5 * MiB, pin=False, stop=threading.Event())
    assert pool.touched_bytes == pool.capacity_bytes == 5 * MiB
    if kernel_populates:
        assert asked == [(0, 2 * MiB), (2 * MiB, 2 * MiB), (4 * MiB, MiB)]
    else:  # asked once: a kernel without it is not asked again
        assert asked == [(0, 2 * MiB)]
    start = pool.view(0, 1).data_ptr()  # every page of the arena present (pagemap bit 63)
    with open("/proc/self/pagemap", "rb") as f:
        f.seek(start // 4096 * 8)
        entries = f.read(5 * MiB // 4096 * 8)
    present = [
        int.from_bytes(entries[i : i + 8], "little") >> 63 for i in range(0, len(entries), 8)
    ]
    assert len(present) == 5 * MiB // 4096 and all(present)


class _StallsBetweenPieces:
    """A stop event whose ``is_set`` (the warm-up asks it between pieces, holding no lock)
    stalls once a piece is touched, until ``go``: a warm-up starved of CPU."""

    def __init__(self, pool: StagingPool) -> None:
        self.pool, self.stalled, self.go = pool, threading.Event(), threading.Event()

    def is_set(self) -> bool:
        if self.pool.touched_bytes > 0:
            self.stalled.set()
            self.go.wait(30)
        return False


@pytest.mark.parametrize("madvise", [True, False])
def test_a_save_never_waits_for_a_starved_warmup(monkeypatch, madvise):
    """Regression (a priority inversion): the warm-up runs at the background CPU level, and it
    touched the whole arena holding the pool's lock, so a first save's ``reserve`` waited, in
    the training thread, for a thread that busy processes starve. Now the lock is free between
    pieces: ``reserve`` returns while the warm-up is stalled, faults the rest of the arena in
    itself, and the warm-up touches no piece after it (with ``madvise`` and without: the
    fallback writes a byte per page, so it may run only while no save can stage)."""
    from flashckpt.engine.save import staging

    monkeypatch.setattr(staging, "TOUCH_PIECE", MiB)
    if not madvise:
        monkeypatch.setattr(staging, "_populate", lambda *a: False)
    touched: list[int] = []
    real_touch = staging._touch_pages

    def counted(flat, start, end):
        if threading.current_thread().name == "warm":
            touched.append(start)
        real_touch(flat, start, end)

    monkeypatch.setattr(staging, "_touch_pages", counted)
    pool = StagingPool(budget_bytes=16 * MiB, chunk_bytes=MiB)
    stop = _StallsBetweenPieces(pool)
    warm = threading.Thread(
        target=pool.warm, kwargs={"needed_bytes": 8 * MiB, "pin": False, "stop": stop}, name="warm"
    )
    warm.start()
    try:
        assert stop.stalled.wait(30)
        assert 0 < pool.touched_bytes < 8 * MiB
        reserved = threading.Event()
        saver = threading.Thread(
            target=lambda: (pool.reserve(needed_bytes=8 * MiB, pin=False), reserved.set())
        )
        saver.start()
        assert reserved.wait(10), "the save's reserve() waited for the stalled warm-up"
        assert pool.capacity_bytes == pool.touched_bytes == 8 * MiB
        start = pool.acquire(8 * MiB)
        pool.view(start, 8 * MiB).fill_(5)
        seen = len(touched)
    finally:
        stop.go.set()
        warm.join(30)
    assert not warm.is_alive()
    assert len(touched) == seen, "the warm-up touched a piece after the save had reserved"
    assert bool((pool.view(start, 8 * MiB) == 5).all()), "the warm-up wrote into staged bytes"


def test_a_pool_that_leaves_faults_to_the_copies_reserves_without_touching() -> None:
    """``fault_in=False`` (the save's copies split across threads while waited for, so they
    take the faults on every core: engine/save/copier.py): reserve() maps the arena and faults
    nothing in; the copies into it are whole."""
    pool = StagingPool(budget_bytes=16 * MiB, chunk_bytes=MiB, fault_in=False)
    pool.reserve(needed_bytes=6 * MiB, pin=False)
    assert pool.capacity_bytes == 6 * MiB and pool.touched_bytes == 0
    start = pool.view(0, 1).data_ptr()
    with open("/proc/self/pagemap", "rb") as f:  # no page of it present yet (pagemap bit 63)
        f.seek(start // 4096 * 8)
        entries = f.read(6 * MiB // 4096 * 8)
    assert not any(
        int.from_bytes(entries[i : i + 8], "little") >> 63 for i in range(0, len(entries), 8)
    )
    pool.view(0, 6 * MiB).fill_(5)
    assert int(pool.view(6 * MiB - 1, 1)) == 5
    faulting = StagingPool(budget_bytes=16 * MiB, chunk_bytes=MiB)  # the default: faulted in
    faulting.reserve(needed_bytes=6 * MiB, pin=False)
    assert faulting.touched_bytes == 6 * MiB
