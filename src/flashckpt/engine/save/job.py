"""One save, moving through time: stage -> persist -> commit.

The staging thread walks the chunk layout in order. A CPU chunk expected to change (it changed
at the last save, or no save of this process has seen it) is copied into a staging slot at once
and hashed from the copy by a persist worker: one pass over its bytes while training waits. A
chunk expected unchanged is first checked where it lies (xxh3-128 of the live bytes on CPU; a
device fingerprint on CUDA, so an unchanged chunk is never copied to the host) and copied only
if it changed. The persist workers encode, write and fsync each chunk and free its slot. When
every chunk is staged, ``staged`` completes; when every chunk is durable, the manifest is
committed and ``durable`` completes. A failure anywhere stops the pipeline, deletes the chunks
this save wrote, and never touches an existing manifest.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from contextlib import suppress
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from flashckpt.engine.gcpause import paused_gc
from flashckpt.engine.save.context import SaveContext
from flashckpt.engine.save.devstage import DeviceStager
from flashckpt.engine.save.direct import Copied, DirectStager, region
from flashckpt.engine.save.handle import SaveHandle, as_save_error
from flashckpt.engine.save.hooks import MutationGuard
from flashckpt.engine.save.layout import ChunkPlan, joined
from flashckpt.engine.save.ledger import ChunkLedger
from flashckpt.engine.save.manifests import Draft, draft, job_manifest
from flashckpt.engine.save.staging import StagingPool
from flashckpt.engine.tiers.tiercopy import Fresh
from flashckpt.errors import FlashCkptError, SaveError
from flashckpt.state.capture import Captured
from flashckpt.store.format import codec as codecs
from flashckpt.store.format.manifest import Manifest
from flashckpt.store.gc import collect_garbage

if TYPE_CHECKING:
    from flashckpt.engine.tiers.build import Tier

log = logging.getLogger(__name__)

Committer = Callable[[Manifest, list[str]], None]
"""``commit(manifest, chunk_dirs)`` makes the checkpoint exist (single rank: write the manifest;
distributed: write this rank's part, barrier, rank 0 publishes)."""


class SaveJob:
    """One save on its staging thread: :meth:`run` stages, persists and commits.

    Everything about one save lives here, never on the Checkpointer: the ``tier`` it commits
    to, its chunk decisions and pins (``ledger``, engine/save/ledger.py; :attr:`pinned_hashes`), its
    ``manifest`` once durable, the device
    fingerprints it observed (published to the shared table only after its commit), and the
    ``guard`` that fails it when a protected tensor changed before staging finished.

    Extension points for a commit protocol (``distributed/commit.py`` uses them):
    :meth:`build_manifest` (what this rank commits), :meth:`agree_failure` (turn a local failure
    into the error every participant reports) and :meth:`cleanup_after_failure` (remove what the
    failed save wrote).
    """

    def __init__(
        self,
        *,
        ctx: SaveContext,
        handle: SaveHandle,
        captured: Captured,
        chunks: list[ChunkPlan],
        committer: Committer | None = None,
        tier: Tier | None = None,
        guard: MutationGuard | None = None,
    ) -> None:
        self.ctx = ctx
        self.tier = tier
        self.handle = handle
        self.captured = captured
        self.chunks = chunks
        self.committer = committer if committer is not None else self._commit_to_store
        self.guard = guard
        # device fingerprints seen by this save; become the shared table only once committed
        self._new_fingerprints: dict[tuple[Any, ...], tuple[tuple[int, int], str]] = {}
        self.hashes: list[str] = [""] * len(chunks)
        self.ledger = ChunkLedger(
            store=ctx.store, step=handle.step, incremental=ctx.incremental, stats=handle.stats
        )
        self._pending: list[Future[None]] = []  # persist work handed to the workers
        self._error: BaseException | None = None  # the first failure; workers stop taking chunks
        self._error_lock = threading.Lock()
        self._device: DeviceStager | None = None  # device chunks (engine/save/devstage.py)
        self._deferred: list[tuple[Any, ...]] = []
        # CPU chunks staged straight into a memory tier's files (engine/save/direct.py)
        self._direct: DirectStager | None = None
        self.manifest: Manifest | None = None  # this rank's committed manifest, once durable
        self._draft: Draft | None = None  # made while the chunks are written (manifests.py)
        self.t0 = time.perf_counter()

    def take_fresh(self) -> Fresh:
        """The memory-tier chunks this save staged, still mapped (engine/save/direct.py): the
        caller hands them to the step's promotion or closes them."""
        return self._direct.take_fresh() if self._direct is not None else Fresh()

    @property
    def pinned_hashes(self) -> set[str]:
        return {h for h in self.hashes if h}

    def run(self) -> None:
        """Stage every chunk, wait for persist, commit. Sets the handle's futures."""
        stats = self.handle.stats
        try:
            self._stage_all()
            if self.guard is not None:
                self.guard.check(self.handle.step)
            stats.staged_s = time.perf_counter() - self.t0
            self.handle.staged.set_result(stats)
            self._flush()
            # while the workers write: the manifest's tensor entries and their JSON
            with paused_gc():  # three objects per tensor (engine/gcpause.py)
                self._draft = draft(chunks=self.chunks, captured=self.captured, ctx=self.ctx)
            for f in self._pending:
                f.result()
            self._raise_if_failed()
            manifest = self.build_manifest()
            self.committer(manifest, [])  # each chunk's directory was fsynced after its rename
            self.release_pins()
            self.manifest = manifest
            self.ctx.fingerprints.update(self._new_fingerprints)
            stats.background_s = time.perf_counter() - self.t0
            self.handle.durable.set_result(stats)
        except BaseException as exc:
            self._fail(exc)

    # -- staging ----------------------------------------------------------------------------
    def _stage_all(self) -> None:
        items = self.captured.items
        host: dict[int, np.ndarray] = {}  # each CPU item's bytes as NumPy, made once per save
        for ci, chunk in enumerate(self.chunks):
            self._raise_if_failed()
            if chunk.device == "cpu":  # NumPy slices: a tenth of the cost of Tensor slices
                views = []
                for p in chunk.pieces:
                    arr = host.get(p.item)
                    if arr is None:
                        arr = items[p.item].data.numpy()
                        if p.length == arr.size:  # all of it: a small tensor of a pack
                            views.append(arr)
                            continue
                        host[p.item] = arr
                    views.append(arr[p.start : p.start + p.length])
                self._stage_cpu(ci, chunk, views)
            else:
                parts = [items[p.item].data[p.start : p.start + p.length] for p in chunk.pieces]
                self._stage_device(ci, chunk, parts)

    def _stage_cpu(self, ci: int, chunk: ChunkPlan, views: list[np.ndarray]) -> None:
        if self.ctx.pool is None and not self.ctx.direct:
            # a synchronous save: the state cannot change until save() returns, so the workers
            # hash and write straight from the live tensors, in parallel (no staging copy)
            self._submit(ci, None, chunk, views, None)
            return
        if self.ctx.direct:
            if self._direct is None:
                self._direct = DirectStager(self.ctx, reuse=self._reuse, landed=self.ledger.landed)
            self._direct.stage(ci, chunk, joined(views, chunk.size), region(self.captured, chunk))
            return
        key = region(self.captured, chunk)
        h: str | None = None
        if self.ctx.hints.get(key) is False:  # unchanged at the last save: hash first, and an
            h = codecs.hash_parts(views)  # unchanged chunk is never copied
            if self._reuse(ci, h, chunk.size):
                return
        # anything else (changed last time, or never seen: a first save, a restart) is most
        # likely changed: copied at once and hashed from the copy by a persist worker, so the
        # blocking part is one pass over its bytes
        self.ctx.hints[key] = True
        pool = self._require_pool()
        slot = self._acquire(chunk.size)
        try:
            buf = pool.view(slot, chunk.size).numpy()
            # numpy's memcpy of all the pieces at once, split across the cores while the loop
            # waits for it (not Tensor.copy_'s thread team: engine/save/copier.py says why)
            self.ctx.copier.copy(buf, views)
        except BaseException:
            pool.release(slot)
            raise
        self._submit(ci, h, chunk, [buf], slot, hint=None if h is not None else key)

    def _name_staged(self, c: Copied) -> None:
        """A persist worker: name one chunk copied into a recycled file (direct.py)."""
        if self._error is not None or self._direct is None:
            c.staged.abort()
            return
        try:
            self._direct.name(c)
        except BaseException as exc:
            self._record_error(exc)
            raise

    def _stage_device(self, ci: int, chunk: ChunkPlan, parts: list[torch.Tensor]) -> None:
        if self._device is None:
            self._device = DeviceStager(
                self.ctx, reuse=self._reuse, acquire=self._acquire, submit=self._submit
            )
        self._device.stage(ci, chunk, parts, region(self.captured, chunk))

    def _acquire(self, nbytes: int) -> int:
        """A staging range for ``nbytes``. Staged chunks wait (deferred) until staging ends, so
        persist work never competes with the copies training is waiting for; only when the
        pool is full are they handed to the workers early, to free space (a state larger than
        the budget then flows through in waves)."""
        pool = self._require_pool()
        slot = pool.try_acquire(nbytes)
        if slot is None:
            self._flush()
            slot = pool.acquire(nbytes)
        return slot

    def _flush(self) -> None:
        copies = self._direct.take_deferred() if self._direct is not None else []
        for c in copies:  # hash and name the chunks copied into recycled files (direct.py)
            self._pending.append(self.ctx.workers.submit(self._name_staged, c))
        deferred, self._deferred = self._deferred, []
        for args in deferred:
            self._submit_now(*args)

    def _require_pool(self) -> StagingPool:
        if self.ctx.pool is None:
            raise RuntimeError("device tensors need a staging pool")
        return self.ctx.pool

    def _reuse(self, ci: int, h: str, size: int) -> bool:
        """Record chunk ``ci`` as ``h``; True when no write is needed (engine/save/ledger.py)."""
        self.hashes[ci] = h
        return self.ledger.reuse(ci, h, size)

    def release_pins(self, *, failed: bool = False) -> None:
        """End this save's liveness window: after its manifest (or rank part) is committed,
        or (``failed=True``) when it gave up. Idempotent."""
        self.ledger.release(failed=failed)

    # -- persisting -------------------------------------------------------------------------
    def _submit(
        self,
        ci: int,
        h: str | None,
        chunk: ChunkPlan,
        bufs: list[Any],
        slot: int | None,
        fingerprint: tuple[Any, Any, str | None] | None = None,
        hint: Any = None,
    ) -> None:
        """Hand a staged chunk to a persist worker (``h=None``: the worker hashes it first;
        ``hint``: the chunk's :func:`region`, marked unchanged there when its hash is reused);
        deferred until staging ends when it sits in a staging slot."""
        if slot is not None:
            self._deferred.append((ci, h, chunk, bufs, slot, fingerprint, hint))
            return
        self._submit_now(ci, h, chunk, bufs, slot, fingerprint, hint)

    def _submit_now(
        self,
        ci: int,
        h: str | None,
        chunk: ChunkPlan,
        bufs: list[Any],
        slot: int | None,
        fingerprint: tuple[Any, Any, str | None] | None = None,
        hint: Any = None,
    ) -> None:
        codec = codecs.choose_codec(self.ctx.compression, chunk.itemsize)
        try:
            fut = self.ctx.workers.submit(
                self._persist, ci, h, chunk.size, bufs, codec, slot, fingerprint, hint
            )
        except BaseException:
            if slot is not None and self.ctx.pool is not None:
                self.ctx.pool.release(slot)
            raise
        self._pending.append(fut)

    def _persist(
        self,
        ci: int,
        h: str | None,
        size: int,
        bufs: list[Any],
        codec: str,
        slot: int | None,
        fingerprint: tuple[Any, Any, str | None] | None,
        hint: Any = None,
    ) -> None:
        try:
            if self._error is not None:
                return
            if h is None:
                bufs = joined(bufs, size)  # (a synchronous save's pack of small tensors)
                h = codecs.hash_parts(bufs)
                if fingerprint is not None and fingerprint[1] is not None:
                    self._new_fingerprints[fingerprint[0]] = (fingerprint[1], h)
                expect = fingerprint[2] if fingerprint is not None else None
                if expect is not None and h != expect:
                    raise SaveError(
                        f"checkpoint step {self.handle.step}: chunk {ci} has an unchanged device "
                        f"fingerprint but hashes to {h}, not {expect}; nothing was committed. "
                        "Save again with incremental=False and report this"
                    )
                if expect is None and self._reuse(ci, h, size):
                    if hint is not None:  # hashed first at the next save
                        self.ctx.hints[hint] = False
                    return
            self.ledger.landed(h, self.ctx.store.put_chunk(h, size, bufs, codec))
            # the rename durable too, here in the worker, while the other chunks are written:
            # the commit then waits for no fsync of a chunk directory (one after another on
            # the caller's thread, they cost a 123 MiB save 0.4-1.3 s, more than torch.save)
            self.ctx.store.backend.sync_dirs(self.ctx.store.chunk_dirs([h]))
        except BaseException as exc:
            self._record_error(exc)
            raise
        finally:
            if slot is not None and self.ctx.pool is not None:
                self.ctx.pool.release(slot)

    def _record_error(self, exc: BaseException) -> None:
        with self._error_lock:
            if self._error is None:
                self._error = exc

    def _raise_if_failed(self) -> None:
        err = self._error
        if err is not None:
            raise err

    # -- commit / failure -------------------------------------------------------------------
    def _commit_to_store(self, manifest: Manifest, chunk_dirs: list[str]) -> None:
        """The single-rank commit: the manifest lands in this save's store, written last."""
        self.ctx.store.commit(manifest, chunk_dirs=chunk_dirs)

    def build_manifest(self) -> Manifest:
        """This rank's manifest of the save, once every chunk is durable."""
        return job_manifest(
            step=self.handle.step,
            hashes=self.hashes,
            refs=self.ledger.refs,
            chunks=self.chunks,
            captured=self.captured,
            ctx=self.ctx,
            stats=self.handle.stats.as_dict(),
            drafted=self._draft,
        )

    def _fail(self, exc: BaseException) -> None:
        if self.guard is not None:
            self.guard.close()
        self._stop_workers(exc)
        exc = self.agree_failure(exc)
        self.cleanup_after_failure()
        err = as_save_error(exc, self.handle.step)
        for fut in (self.handle.staged, self.handle.durable):
            if not fut.done():
                fut.set_exception(err)

    def _stop_workers(self, exc: BaseException) -> None:
        """Record the first error (workers stop taking chunks), give back the staging ranges of
        chunks never handed to a worker, and wait until no worker is running."""
        self._record_error(exc)
        deferred, self._deferred = self._deferred, []
        for args in deferred:
            if self.ctx.pool is not None:
                self.ctx.pool.release(args[4])
        if self._direct is not None:
            self._direct.abort_deferred()
        for f in self._pending:
            with suppress(BaseException):
                f.result()
        self.take_fresh().close()  # no worker adds to it any more

    def agree_failure(self, exc: BaseException) -> BaseException:
        """The error this save fails with (single rank: its own)."""
        return exc

    def cleanup_after_failure(self) -> None:
        """Give back this save's pins; the chunks it wrote that nothing else references are
        collected now, or by the next collection when another process is writing the root
        (the liveness module keeps them as candidates, on disk too)."""
        self.release_pins(failed=True)
        if not self.ledger.written:
            return
        try:
            res = collect_garbage(self.ctx.store)
        except FlashCkptError as exc:
            log.warning("could not clean up after failed save %d: %s", self.handle.step, exc)
            return
        if res.skipped:
            log.info("chunks of failed save %d left for later: %s", self.handle.step, res.skipped)
