"""One save's chunk ledger: which of its chunks writes which bytes, which stored chunks it
reuses, what it wrote, and the liveness window that keeps all of them alive until its commit.

The ledger owns the "write or reuse" decision for every chunk of one save; the staging thread
and the persist workers of :class:`~flashckpt.engine.save.job.SaveJob` ask it under one lock:

- a hash is pinned in the save's liveness window (store/liveness.py) *before* it is decided, so
  a garbage collection running meanwhile never deletes a chunk this save is about to name;
- a stored chunk is reused only when the tier holds it at the right size and it is not
  quarantined (``Window.claim``); otherwise the chunk is claimed and written;
- bytes that appear twice in one save are written once (the later chunk names the earlier's).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from flashckpt.engine.save.handle import SaveStats
from flashckpt.store.format.manifest import ChunkRef
from flashckpt.store.pins import Window
from flashckpt.store.store import CheckpointStore


@dataclass(kw_only=True)
class ChunkLedger:
    store: CheckpointStore  # the tier this save commits to
    step: int
    incremental: bool  # False: every chunk is written, none reused from the store
    stats: SaveStats  # the save's byte counts, kept here as the decisions are made
    refs: dict[str, ChunkRef] = field(default_factory=dict)  # hash -> ref of each chunk named
    written: list[str] = field(default_factory=list)  # hashes this save wrote (cleanup on failure)
    claims: dict[str, int] = field(default_factory=dict)  # hash -> chunk index writing it
    lock: threading.Lock = field(default_factory=threading.Lock)
    window: Window | None = None  # this save's pins, opened at its first decision

    def reuse(self, ci: int, h: str, size: int) -> bool:
        """Decide chunk ``ci`` holding ``h``: True when no write is needed (the bytes are stored,
        or written by an earlier chunk of this save), False when ``ci`` must write them."""
        stats = self.stats
        with self.lock:
            owner = self.claims.get(h)
            if owner == ci:
                return False  # this chunk claimed it before (device fingerprint path): write it
            stats.total_bytes += size
            if h in self.refs or owner is not None:
                stats.reused_bytes += size  # the same bytes appear earlier in this save
                return True
            ref = self._pins().claim(h, size, reuse=self.incremental)
            if ref is not None:
                self.refs[h] = ChunkRef(
                    hash=h, size=size, codec=ref.codec, stored_size=max(ref.stored_size, 0)
                )
                stats.reused_bytes += size
                stats.chunks_reused += 1
                return True
            self.claims[h] = ci  # this chunk writes it; its ref is set when it lands
            stats.new_bytes += size
            stats.chunks_new += 1
        return False

    def landed(self, h: str, ref: ChunkRef) -> None:
        """Chunk bytes ``h`` this save wrote are in the tier (a failure later still cleans
        them up). Persist workers call it concurrently: the counts change under the lock."""
        with self.lock:
            self.refs[h] = ref
            self.written.append(h)
            self.stats.stored_bytes += ref.stored_size

    def release(self, *, failed: bool = False) -> None:
        """End the save's liveness window: after its manifest (or rank part) is committed, or
        (``failed=True``) when it gave up. Idempotent."""
        if self.window is not None:
            self.window.failed() if failed else self.window.committed()

    def _pins(self) -> Window:
        if self.window is None:
            self.window = self.store.liveness.open_window(kind="save", step=self.step)
        return self.window
