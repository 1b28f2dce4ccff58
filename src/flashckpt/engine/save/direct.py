"""Staging straight into a memory tier's chunk files: the file *is* the staged copy, and no
persist worker writes it again (:class:`~flashckpt.engine.save.job.SaveJob` uses it for CPU
chunks of an asynchronous, uncompressed save to a memory tier).

A chunk that changed at the last save is most likely changed again: when retention freed a
file of its size (store/files/staged.py, the recycling pool), the live bytes are copied into
that file's resident pages at once, and a persist worker hashes the copy and names it after
staging ended (the copy is all the optimizer step waits for). Any other chunk is hashed first:
unchanged, it is not copied at all; changed, it is copied once, into a new file. (Hashing and
copying each block while it is in cache was measured slower here: 256 MiB on the 2-core VM,
53 ms against 17 + 25 ms apart.) The job hands in what the decisions need as callables, so
this module knows nothing of it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from flashckpt.engine.save.context import SaveContext
from flashckpt.engine.save.layout import ChunkPlan
from flashckpt.engine.tiers.tiercopy import Fresh
from flashckpt.errors import SaveError
from flashckpt.state.capture import Captured
from flashckpt.store.format import codec as codecs
from flashckpt.store.format.manifest import ChunkRef
from flashckpt.store.store import CheckpointStore, StagedChunk


def region(captured: Captured, chunk: ChunkPlan) -> tuple[Any, ...]:
    """What a chunk holds, as a key that is the same at the next save of the same state."""
    return tuple((captured.items[p.item].key, p.start, p.length) for p in chunk.pieces)


@dataclass(frozen=True)
class Copied:
    """A chunk copied into a recycled file, still to be hashed and named (by a worker)."""

    ci: int
    chunk: ChunkPlan
    staged: StagedChunk
    key: Any


class DirectStager:
    def __init__(
        self,
        ctx: SaveContext,
        *,
        reuse: Callable[[int, str, int], bool],
        landed: Callable[[str, ChunkRef], None],
    ) -> None:
        """``ctx``: the save's context (its tier's store, the hints of the last save);
        ``reuse(ci, h, size)``: the job's write-or-reuse decision; ``landed(h, ref)``: a chunk
        this save wrote is in the tier."""
        self.store: CheckpointStore = ctx.store
        self.hints = ctx.hints
        self._reuse, self._landed = reuse, landed
        # the published chunks copied into recycled files, their pages still mapped: the
        # step's promotion writes them to the disk as they are (engine/tiers/tiercopy.py)
        self._fresh = Fresh()
        self._deferred: list[Copied] = []
        self._lock = threading.Lock()
        self._copy = ctx.copier.copy

    def stage(self, ci: int, chunk: ChunkPlan, views: list[np.ndarray], key: Any) -> None:
        """Stage chunk ``ci`` (its live bytes ``views``; ``key``: its :func:`region`)."""
        staged = self.store.stage_chunk(chunk.size) if self.hints.get(key) else None
        try:
            if staged is not None and staged.recycled:  # on every core while waited for
                staged.fill(views, self._copy)
                with self._lock:
                    self._deferred.append(Copied(ci, chunk, staged, key))
                return
            h = codecs.hash_parts(views)
            if self._reuse(ci, h, chunk.size):
                if staged is not None:
                    staged.abort()
                self.hints[key] = False
                return
            if staged is None:
                staged = self.store.stage_chunk(chunk.size)
            if staged is None:  # the tier cannot (not local)
                raise SaveError(f"tier {self.store.url} cannot stage chunks in place")
            for v in views:
                staged.write(v)
            self._publish(h, chunk, staged)
        except BaseException:
            if staged is not None:
                staged.abort()
            raise
        self.hints[key] = True

    def take_fresh(self) -> Fresh:
        """The pages kept mapped so far (the caller closes them or hands them on)."""
        with self._lock:
            fresh, self._fresh = self._fresh, Fresh()
        return fresh

    def take_deferred(self) -> list[Copied]:
        """The copies still to be hashed and named, for the persist workers (staging ended)."""
        with self._lock:
            out, self._deferred = self._deferred, []
        return out

    def abort_deferred(self) -> None:
        """The save failed before its copies were handed out: drop them."""
        for c in self.take_deferred():
            c.staged.abort()

    def name(self, c: Copied) -> None:
        """Hash a copy and publish it under its hash, or drop it when the tier holds those
        bytes already (a persist worker)."""
        try:
            h = codecs.hash_parts([c.staged.view()])
            if self._reuse(c.ci, h, c.chunk.size):
                c.staged.abort()
                self.hints[c.key] = False
                return
            self._publish(h, c.chunk, c.staged, hashed_here=True)
        except BaseException:
            c.staged.abort()
            raise

    def _publish(
        self, h: str, chunk: ChunkPlan, staged: StagedChunk, *, hashed_here: bool = False
    ) -> None:
        """Name ``staged`` ``h``. Its pages are kept for the promotion only when ``h`` was
        computed from them (``hashed_here``), not from the live tensors before the copy."""
        pages = staged.keep_pages() if hashed_here else None
        try:
            ref = staged.publish(h, chunk.size)
        except BaseException:
            if pages is not None:
                pages.close()
            raise
        self._landed(h, ref)
        if pages is not None:
            with self._lock:
                fresh = self._fresh
            fresh.add(h, pages)
        self.store.backend.sync_dirs(self.store.chunk_dirs([h]))
