"""Copying one committed step from a faster tier to a slower one (what promotion does).

The chunks the destination lacks are copied on a few worker threads: each chunk is read back
from the source and verified against its hash (a damaged copy never spreads), written to the
destination (fsynced there, or uploaded), and only then is the manifest committed. The copy is
a writer of the destination like a save: it runs inside a liveness window there
(:mod:`flashckpt.store.liveness`), so no garbage collection deletes a chunk it reuses or writes
before its manifest lands, and a copy that fails (ENOSPC) leaves its chunks as gc candidates
rather than orphans. A damaged source chunk is quarantined by the store's read. Per-chunk
fsync or request latency, not bandwidth, bounds a sequential copy, so several run at once.

From a memory tier a chunk is mapped where it rests, verified there, and its pages are handed
to the destination's write as they are (the disk tier writes them with O_DIRECT): one read to
verify, no copy. A chunk the save has just staged into a recycled file of the memory tier is
not even read: the save kept that file's mapping (:class:`Fresh`), and the copy writes those
pages, whose hash was computed from them, as they are. The recycling pool's write lease keeps
them from being refilled meanwhile (store/files/staged.py).

From other tiers each worker copies raw chunks through a page-aligned buffer
kept from step to step, so the disk tier can still write it with O_DIRECT and no chunk-sized
``bytes`` is allocated (and its pages faulted in) per chunk; those buffers cost ``workers`` x
the largest chunk of host memory until the Checkpointer closes.
"""

from __future__ import annotations

import dataclasses
import logging
import mmap
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from flashckpt.errors import FlashCkptError
from flashckpt.store.files.directio import aligned
from flashckpt.store.files.staged import Pages
from flashckpt.store.format.manifest import ChunkRef, Manifest
from flashckpt.store.gc import collect_garbage
from flashckpt.store.store import maps_chunks

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from flashckpt.engine.tiers.build import Tier


class PromotionStopped(FlashCkptError):
    """The promoter is stopping (close()): the copy ended between two chunks."""


class Fresh:
    """The chunks one save has just written into a memory tier, with their pages still mapped
    (:meth:`~flashckpt.store.store.StagedChunk.keep_pages`), by hash. Their hash was computed
    from those very pages, so promotion writes them to the slower tier as they are, without
    mapping the file and hashing it a second time. The save job holds it until the step's
    promotion task takes it (:class:`~flashckpt.engine.tiers.promote.PromoteTask`); whoever
    holds it last closes it, and a closed one keeps nothing added later."""

    def __init__(self) -> None:
        self._pages: dict[str, Pages] = {}
        self._closed = False
        self._lock = threading.Lock()

    def add(self, h: str, pages: Pages) -> None:
        with self._lock:
            if not self._closed and h not in self._pages:
                self._pages[h] = pages
                return
        pages.close()

    def get(self, h: str) -> Any:
        """The chunk's bytes, or None when this save did not map them."""
        with self._lock:
            pages = self._pages.get(h)
        return None if pages is None else pages.buffer

    def close(self) -> None:
        with self._lock:
            pages, self._pages, self._closed = self._pages, {}, True
        for p in pages.values():
            p.close()


def _never() -> bool:
    return False


def started(hook: Callable[[], None] | None) -> None:
    """Run a thread's start hook (its CPU level); a failure costs only the level."""
    if hook is None:
        return
    try:
        hook()
    except Exception as exc:  # never stop a copy for it
        log.warning("could not set a background thread's CPU level: %s", exc)


class ChunkCopier:
    """Copies chunks on up to ``workers`` daemon threads per step (a stuck upload never holds
    up interpreter exit), each with a page-aligned buffer kept for the next step."""

    def __init__(self, workers: int) -> None:
        self.workers = workers
        self.thread_start: Callable[[], None] | None = None  # run first on each copy thread
        self._spare: list[_Buffer] = []
        self._lock = threading.Lock()

    def copy(
        self,
        src: Tier,
        dst: Tier,
        refs: list[ChunkRef],
        step: int,
        stop: Callable[[], bool] = _never,
        fresh: Fresh | None = None,
    ) -> list[ChunkRef]:
        """Copy ``refs`` from ``src`` to ``dst``; their new refs, in order (``fresh``: chunks
        whose pages the save still maps). The first error (or ``stop()`` turning True) stops
        the workers from starting more chunks and is raised once all have stopped."""
        results: list[ChunkRef | None] = [None] * len(refs)
        errors: list[BaseException] = []
        todo = iter(range(len(refs)))

        def work() -> None:
            started(self.thread_start)
            buf = self._take()
            try:
                while True:
                    if stop():
                        raise PromotionStopped(f"promotion of step {step} stopped at close")
                    with self._lock:
                        i = None if errors else next(todo, None)
                    if i is None:
                        return
                    results[i] = self._copy_one(src, dst, refs[i], step, buf, fresh)
            except BaseException as exc:
                with self._lock:
                    errors.append(exc)
            finally:
                with self._lock:
                    self._spare.append(buf)

        threads = [
            threading.Thread(target=work, name=f"flashckpt-copy-{k}", daemon=True)
            for k in range(min(self.workers, len(refs)))
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        return [r for r in results if r is not None]

    def close(self) -> None:
        """Release the buffers (a later copy allocates new ones)."""
        with self._lock:
            self._spare.clear()

    def _take(self) -> _Buffer:
        with self._lock:
            return self._spare.pop() if self._spare else _Buffer()

    @staticmethod
    def _copy_one(
        src: Tier, dst: Tier, ref: ChunkRef, step: int, buf: _Buffer, fresh: Fresh | None
    ) -> ChunkRef:
        raw: Any = fresh.get(ref.hash) if fresh is not None and ref.codec == "raw" else None
        if raw is not None:  # just staged and hashed from these pages: written as they are
            return dst.store.put_chunk(ref.hash, ref.size, [raw], ref.codec)
        if ref.codec == "raw" and maps_chunks(src.store):
            # a memory tier: write its pages as they are (mapped and verified; the disk tier's
            # O_DIRECT write takes them without a copy through a buffer)
            raw = src.store.map_chunk(ref, step=step)
            try:
                return dst.store.put_chunk(ref.hash, ref.size, [raw], ref.codec)
            finally:
                if isinstance(raw, mmap.mmap):
                    raw.close()
        if ref.codec == "raw":
            raw = buf.view(ref.size)
            src.store.read_chunk_into(ref, raw, step=step)  # verified against its hash
        else:
            raw = src.store.read_chunk(ref, step=step)  # verified against its hash
        return dst.store.put_chunk(ref.hash, ref.size, [raw], ref.codec)


class _Buffer:
    """A page-aligned, growable host buffer (anonymous memory map)."""

    def __init__(self) -> None:
        self._map: mmap.mmap | None = None

    def view(self, nbytes: int) -> memoryview:
        if self._map is None or len(self._map) < nbytes:
            self._map = mmap.mmap(-1, aligned(nbytes))  # page-aligned, whole pages
        return memoryview(self._map)[:nbytes]


def copy_step(
    src: Tier,
    dst: Tier,
    manifest: Manifest,
    copier: ChunkCopier,
    *,
    stop: Callable[[], bool] = _never,
    fresh: Fresh | None = None,
) -> tuple[int, int]:
    """Copy the chunks ``dst`` lacks, then the manifest (``fresh``: the pages of chunks the
    save just wrote to ``src``, :class:`Fresh`). Returns (bytes copied, chunks copied)."""
    win = dst.store.liveness.open_window(kind="promote", step=manifest.step)
    try:
        refs: dict[str, ChunkRef] = {}
        missing: dict[str, ChunkRef] = {}
        for ref in manifest.chunks:
            if ref.hash in refs or ref.hash in missing:
                continue
            have = win.claim(ref.hash, ref.size)
            if have is None:
                missing[ref.hash] = ref
            else:
                refs[ref.hash] = dataclasses.replace(
                    ref, codec=have.codec, stored_size=max(have.stored_size, 0)
                )
        for new in copier.copy(src, dst, list(missing.values()), manifest.step, stop, fresh):
            refs[new.hash] = new
        copy = dataclasses.replace(manifest, chunks=[refs[r.hash] for r in manifest.chunks])
        dst.store.commit(copy, chunk_dirs=dst.store.chunk_dirs(list(missing)))
    except BaseException:
        win.failed()
        try:
            collect_garbage(dst.store)
        except FlashCkptError:
            pass  # the candidates stay recorded for the next collection
        raise
    win.committed()
    return sum(r.size for r in missing.values()), len(missing)
