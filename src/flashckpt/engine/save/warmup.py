"""What a Checkpointer's first save would otherwise pay once, done in the background at start.

Every restart begins with a save, and a first save used to cost more than a warm one: on the
2-core CPU host, faulting in a fresh 1.2 GB staging arena took 3.2-3.6 s against 0.5 s to copy
into it again, and a tier's first save listed every chunk directory before its first write.
So at construction a daemon thread, never blocking the constructor:

1. starts the stager and every persist worker thread (executors start threads lazily);
2. when saves stage through the pool (``async_save=True`` without a memory tier, whose files
   CPU chunks are staged into directly; or CUDA usable: device tensors always stage), reserves
   and touches the staging arena (:meth:`StagingPool.warm`). With CUDA usable it is pinned only
   when this process has a CUDA context already, and then on a device that has one (torch's
   pinned allocator picks it): pinning needs a context, and before the model is on its device
   the only one it could make is on GPU 0, in every rank. Without a context the first save
   pins, under its own device. The arena is sized like the newest checkpoint
   this rank finds in its local tiers (a restart saves the same state again) and never beyond
   ``host_memory_budget``. A fresh root has no size to go by: the
   arena is then sized by the first save, as before;
3. creates ``chunks/`` and ``steps/`` in each local tier, makes them durable once, and lists
   the chunks the tier holds (the index the first save would otherwise build before its first
   write: one listing per chunk directory).

The warm-up thread runs at the background CPU level (engine/runtime/priority.py), so no save
ever waits for it: a save that arrives before the warm-up is done faults what is left of the
arena in itself (``StagingPool.reserve``), and the warm-up stops before its next piece.
:meth:`Warmup.stop` (close) ends the warm-up between pieces and waits for its thread. A
failure here is logged and costs nothing but the warm-up: the save path does everything again
itself when needed.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Executor

from flashckpt.engine.device import DeviceOps
from flashckpt.engine.save.staging import StagingPool
from flashckpt.store.files.backend import LocalBackend
from flashckpt.store.files.directio import aligned
from flashckpt.store.store import CheckpointStore

log = logging.getLogger(__name__)

SYNC_IO_THREADS = 16
"""Persist threads of a Checkpointer with synchronous saves (unless ``persist_workers`` says):
the caller waits anyway, and chunk fsyncs issued together are served by fewer journal commits
and device flushes (123 MiB in 124 chunk files on the 2-core host: 481 ms with 16 threads,
592 ms with 4, 668 ms as one file with one fsync)."""


def persist_threads(*, workers: int, persist_workers: int, async_save: bool) -> int:
    """Threads of the persist pool: ``workers`` (from ``persist_workers`` or the CPU count)
    for asynchronous saves, which run beside training; at least :data:`SYNC_IO_THREADS` for
    synchronous ones."""
    if persist_workers or async_save:
        return workers
    return max(workers, SYNC_IO_THREADS)


START_WAIT_S = 1.0  # how long a placeholder task holds its thread while the others start


class Warmup:
    def __init__(
        self,
        *,
        pool: StagingPool,
        executors: Sequence[tuple[Executor, int]],
        stores: Sequence[CheckpointStore],
        rank: int,
        async_save: bool,
        device: DeviceOps,
        direct: bool = False,
        thread_start: Callable[[], None] | None = None,
    ) -> None:
        self.pool = pool
        self.thread_start = thread_start  # run first on the warm-up thread (its CPU level)
        self.direct = direct  # CPU saves stage into the memory tier's files: no arena for them
        self.executors = executors  # (executor, its thread count)
        self.stores = stores
        self.rank = rank
        self.async_save = async_save
        self.device = device
        self.done = threading.Event()
        self.staged_bytes = 0  # the arena size it warmed (0: none)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="flashckpt-warmup", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 30.0) -> None:
        """End the warm-up (close): between touched pieces, then wait for the thread."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout_s)

    def _run(self) -> None:
        # the arena first: touching it is by far the longest part (seconds per GB)
        try:
            if self.thread_start is not None:
                self.thread_start()
            for ex, n in self.executors:
                _start_threads(ex, n, self._stop)
            # pin only where a context exists (never make one: it would be on GPU 0)
            pin = self.device.available() and self.device.has_context()
            arena = pin or (self.async_save and not self.direct)
            if arena and not self._stop.is_set():
                nbytes = expected_staging_bytes(self.stores, self.rank)
                if nbytes:
                    self.pool.warm(needed_bytes=nbytes, pin=pin, stop=self._stop, device=None)
                    self.staged_bytes = self.pool.capacity_bytes
            for store in self.stores:
                if not self._stop.is_set():
                    _prepare_store(store)
        except Exception as exc:  # the save path does all of this itself when it must
            log.info("checkpoint warm-up stopped early (the first save does the rest): %s", exc)
        finally:
            self.done.set()


def _start_threads(ex: Executor, n: int, stop: threading.Event) -> None:
    """Start ``n`` threads of ``ex`` now: ``n`` placeholder tasks that hold their thread until
    all were submitted (an idle thread would otherwise be reused and the rest start later)."""
    release = threading.Event()
    for _ in range(n):
        if stop.is_set():
            break
        ex.submit(release.wait, START_WAIT_S)
    release.set()


def _prepare_store(store: CheckpointStore) -> None:
    """A local tier's top directories, and its chunk index (the listing of every chunk
    directory that the first save would otherwise make before deciding what to write). The
    256 ``chunks/<xx>`` directories are not made ahead: the first garbage collection sweeps
    every one that exists, which cost a small first save more than creating its few."""
    backend = store.backend
    if isinstance(backend, LocalBackend):
        backend.make_dirs(["chunks", "steps"])
        store.liveness.index()


def expected_staging_bytes(stores: Sequence[CheckpointStore], rank: int) -> int:
    """Staging bytes this rank's next save will need, going by the newest checkpoint of the
    first local tier holding one (the chunks its shards name, each rounded like a staging range);
    0 when there is none or it cannot be read."""
    for store in stores:
        if not isinstance(store.backend, LocalBackend):
            continue  # a remote tier is never listed from here (a slow or billed request)
        try:
            steps = store.steps()
            if not steps:
                continue
            m = store.load_manifest(steps[-1])
        except Exception as exc:
            log.debug("warm-up: no size from %s: %s", store.url, exc)
            continue
        used: set[int] = set()
        for entry in m.tensors.values():
            for shard in entry.shards:
                if shard.rank == rank or m.world_size == 1:
                    used.update(e.chunk for e in shard.extents)
        return sum(aligned(m.chunks[i].size) for i in used if 0 <= i < len(m.chunks))
    return 0
