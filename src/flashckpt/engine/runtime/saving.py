"""A Checkpointer's save path: from ``save(step, state)`` to the bookkeeping of a durable save.

:class:`SavePath` owns what every save uses and nothing else does: the staging pool (its arena a
file in the memory tier when that is on tmpfs: engine/tiers/arena.py), the staging thread and
the persist workers with their copy helpers and warm-up, the CPU level of every background
thread (the promotion's too: engine/runtime/priority.py), the device fingerprints of committed
saves, the optimizer gate (async saves that overlap the next step), the steps a restore found
damaged in every tier (which may be saved again), and ``last_step``. One save: wait for (or skip
past) the one in flight, refuse a step already committed, capture the state, pick its tier,
build the :class:`~flashckpt.engine.save.job.SaveJob` (or, distributed, the commit-protocol job
of distributed/commit.py) and run it on the staging thread or here; when it is durable, journal
it, hand it to promotion and retention (engine/tiers/aftersave.py) and charge its cost to the
meter.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from flashckpt.engine import device as devices
from flashckpt.engine.gcpause import paused_gc
from flashckpt.engine.options import Options
from flashckpt.engine.runtime.governor import FOREGROUND, Governor
from flashckpt.engine.runtime.inflight import InFlight
from flashckpt.engine.runtime.meter import RunMeter
from flashckpt.engine.runtime.priority import ThreadPriority
from flashckpt.engine.save.context import (
    DraftMemo,
    SideStreams,
    build_context,
    wait_for_host_copies,
)
from flashckpt.engine.save.copier import Copier, copy_helpers
from flashckpt.engine.save.fingerprint import Fingerprinter
from flashckpt.engine.save.handle import SaveHandle, SaveStats, as_save_error, failure, settle
from flashckpt.engine.save.hooks import (
    MutationGuard,
    StepGate,
    copy_unprotected,
    find_optimizers,
    module_pointers,
    overlap_safe,
    protected_pointers,
)
from flashckpt.engine.save.job import SaveJob
from flashckpt.engine.save.staging import StagingPool
from flashckpt.engine.save.steps import refuse_existing
from flashckpt.engine.save.warmup import Warmup, persist_threads
from flashckpt.engine.tiers.aftersave import AfterSave
from flashckpt.engine.tiers.arena import ArenaFile
from flashckpt.engine.tiers.tierset import TierSet
from flashckpt.journal import Journal
from flashckpt.state.capture import Captured, capture
from flashckpt.store.format.lineage import Lineage

if TYPE_CHECKING:
    from flashckpt.distributed.runtime import DistRuntime

log = logging.getLogger(__name__)


class SavePath:
    def __init__(
        self,
        *,
        options: Options,
        tiers: TierSet,
        journal: Journal,
        inflight: InFlight,
        meter: RunMeter,
        dist: DistRuntime | None,
        rank: int,
        world_size: int,
        arena: ArenaFile | None = None,
        lineage: Callable[[], Lineage] | None = None,
    ) -> None:
        self.options = options
        self.lineage = lineage  # this writer's lineage, for its manifests
        self.tiers = tiers
        self.journal = journal
        self.inflight = inflight
        self.meter = meter
        self.dist = dist
        self.rank, self.world_size = rank, world_size
        o = options
        # async saves run beside training: their threads run at the background CPU level
        # while the governor keeps them in the background (engine/runtime/priority.py)
        self.priority = ThreadPriority()
        start = self.priority.register if o.async_save else None
        # a staging copy the loop waits for runs on every core (engine/save/copier.py)
        self.copier = Copier(
            helpers=copy_helpers() if o.async_save else 0,
            waited=self.priority.waited,
            thread_start=start,
        )
        # an arena no warm-up faulted in: where copies can split, they take the faults (on
        # every core while waited for: 512 MiB in 0.14 s against 0.19 s faulted in first)
        self.pool = StagingPool(
            budget_bytes=o.host_memory_budget_bytes,
            chunk_bytes=o.chunk_bytes,
            backing=arena,
            fault_in=self.copier.helpers == 0,
        )
        self.stager = ThreadPoolExecutor(1, thread_name_prefix="flashckpt-stage", initializer=start)
        # work no save waits for runs at the background CPU level, at full speed while waited on
        tiers.promoter.on_thread_start(self.priority.register_background)
        tiers.promoter.on_wait(self.priority.background_waited_on)
        self.after = AfterSave(tiers, self.stager)  # promotion + retention
        self.threads = persist_threads(
            workers=o.workers, persist_workers=o.persist_workers, async_save=o.async_save
        )
        self.workers = ThreadPoolExecutor(
            self.threads, thread_name_prefix="flashckpt-persist", initializer=start
        )
        # device fingerprints of committed saves only (a SaveJob publishes its own on commit)
        self.fingerprints: dict[tuple[Any, ...], tuple[tuple[int, int], str]] = {}
        self.fingerprinter = Fingerprinter() if o.incremental else None
        self.streams = SideStreams()  # one side stream per device, for every save
        # which CPU chunks changed at the last direct save (engine/save/job.py _stage_direct)
        self.hints: dict[tuple[Any, ...], bool] = {}
        self.drafts = DraftMemo()  # the last save's manifest draft (engine/save/manifests.py)
        # what each async save costs the loop, and whether the next runs in the background
        self.governor = Governor(
            journal=journal,
            budget_s=o.save_budget_s,
            enabled=o.governor and o.async_save,
            priority=self.priority.describe() if o.async_save else "unmanaged",
        )
        self.gate = StepGate(self._pre_step)
        self.damaged: set[int] = set()  # steps restore() found damaged in every tier
        self.last_step: int | None = None  # the newest step durable or restored

    def _pre_step(self) -> None:
        """The async saves' optimizer pre-step hook: a step begins (the governor's clock),
        and it waits for staging of the save in flight."""
        self.governor.tick()
        if self.inflight.staging():  # (the wait raises the save's threads: SaveHandle)
            self.inflight.wait_staged()

    def settle(self) -> None:
        """The loop waits for what the staging thread has queued (a durable callback, its
        promotion and retention): that thread at the foreground level meanwhile."""
        with self.priority.waited_on():
            self.after.settle()

    def wait_durable(self) -> None:
        """The loop waits for the save in flight to end (a save, ``wait``, ``close``,
        ``restore``), its threads at the foreground level meanwhile (the handle's futures hold
        the hook: engine/save/handle.py)."""
        self.inflight.wait_durable()

    def start_warmup(self) -> Warmup:
        """Ready this save path's threads, chunk directories and arena before the first save,
        on a background-level thread (engine/save/warmup.py); never blocks."""
        warmup = Warmup(
            pool=self.pool,
            executors=[(self.stager, 1), (self.workers, self.threads)],
            stores=[t.store for t in self.tiers.tiers],
            rank=self.rank,
            async_save=self.options.async_save,
            device=devices.current(),
            direct=self.options.compression is None and self.tiers.fastest.name == "memory",
            thread_start=self.priority.register_background,
        )
        warmup.start()
        return warmup

    def stop(self) -> None:
        """Remove the optimizer gate, stop the threads (after their work), free the arena."""
        self.gate.remove()
        self.stager.shutdown(wait=True)
        self.workers.shutdown(wait=True)
        self.copier.shutdown()
        self.pool.close()
        self.drafts.last = None  # (its entries: objects every collection walks)

    def save(self, step: int, state: Mapping[str, Any]) -> SaveHandle:
        t0 = time.perf_counter()
        self.inflight.raise_pending()
        if self.inflight.busy():
            if self.options.on_busy == "skip":
                self.journal.append(
                    "save_skipped", step=step, reason="previous save still persisting"
                )
                return SaveHandle.done_skipped(step)
            self.wait_durable()  # counted in this save's blocking time
            self.inflight.raise_pending()
        if not self.options.async_save:
            self.after.wait()  # the previous save's retention (engine/tiers/aftersave.py)
        refuse_existing(self.tiers.tiers, step, damaged=self.damaged, journal=self.journal)
        with paused_gc():  # a few objects per tensor: no full collections (engine/gcpause.py)
            return self._save(step, state, t0)

    def _save(self, step: int, state: Mapping[str, Any], t0: float) -> SaveHandle:
        """:meth:`save` once the save in flight is out of the way: capture, job, run."""
        captured = capture(state)
        if self.dist is not None:  # keep what this rank writes; per-rank keys renamed
            self.dist.split(captured, state)
        wait_for_host_copies(captured, devices.current())  # D2H copies into pinned tensors
        optimizers = find_optimizers(state) if self.options.async_save else []
        overlap = bool(optimizers) and self.options.overlap and overlap_safe(optimizers)
        if overlap:
            copy_unprotected(captured, protected_pointers(optimizers) | module_pointers(state))
        handle = SaveHandle(step=step, stats=SaveStats(step=step))
        handle.waited_on(self.priority.waited_on)  # whoever waits for it: at full speed
        self.meter.saved(step, time.time())
        mode = self.governor.started(step) if self.options.async_save else None
        if mode is not None:  # the loop waits for a foreground save: its threads at full speed
            self.priority.set("foreground" if mode == FOREGROUND else "background")
        guard = MutationGuard(captured) if overlap else None
        try:
            job = self._job(handle, captured, guard)
        except BaseException:
            if guard is not None:
                guard.close()  # (stops watching .data)
            raise
        self.journal.append("save_start", step=step)
        if self.options.async_save:
            self._run_async(job, handle, wait_staged=not overlap)
            self.gate.install(optimizers)
            if mode == FOREGROUND:  # the governor measured this cheaper: the loop waits
                settle(handle.durable)
        else:
            job.run()
            handle.delivered = True  # a synchronous save raises right here
            self._finish(handle, job)
        handle.add_blocking(time.perf_counter() - t0)
        self.journal.append("staged", step=step, blocking_s=handle.blocking_s)
        if not self.options.async_save:
            exc = failure(handle.durable)
            if exc is not None:
                raise as_save_error(exc, handle.step)
        return handle

    def _job(self, handle: SaveHandle, captured: Captured, guard: MutationGuard | None) -> SaveJob:
        if self.dist is not None:  # rank 0 picks the tier of every rank (distributed/attempt.py)
            tier = self.dist.tier(self.tiers, captured.nbytes)
        else:
            tier = self.tiers.target(step=handle.step, nbytes=captured.nbytes)
        chunks, ctx = build_context(
            captured,
            self.options,
            store=tier.store,
            pool=self.pool,
            workers=self.workers,
            fingerprinter=self.fingerprinter,
            fingerprints=self.fingerprints,
            rank=self.rank,
            world_size=self.world_size,
            direct=tier.name == "memory",  # the staged copy is the memory tier's copy
            hints=self.hints,
            drafts=self.drafts,
            copier=self.copier,
            streams=self.streams,
            lineage=self.lineage() if self.lineage is not None else None,
        )
        common: dict[str, Any] = dict(
            ctx=ctx, handle=handle, captured=captured, chunks=chunks, tier=tier, guard=guard
        )
        if self.dist is not None:  # commit = parts + store barrier + rank 0 publishes
            retain = lambda: self.after(handle.step, tier)  # noqa: E731
            return self.dist.job(retain=retain, **common)
        return SaveJob(**common)

    def _run_async(self, job: SaveJob, handle: SaveHandle, *, wait_staged: bool) -> None:
        self.inflight.start(handle, job)
        handle.durable.add_done_callback(lambda _f: self._finish(handle, job))
        self.stager.submit(job.run)
        if wait_staged:  # its error is raised by the next save() or close(), not here
            settle(handle.staged)

    def _finish(self, handle: SaveHandle, job: SaveJob) -> None:
        """Runs when a save is durable or failed: journal, retention, gc, error bookkeeping.
        Everything it needs comes from ``job`` (the next save may already have started)."""
        exc = failure(handle.durable)
        fresh = job.take_fresh()  # the staged pages it kept mapped: for the promotion
        if exc is not None or self.dist is not None:  # (distributed: its commit promotes)
            fresh.close()
        if exc is not None:
            self.inflight.failed(handle, exc)
            self.journal.append("save_failed", step=handle.step, error=str(exc))
            log.error("checkpoint step %d failed: %s", handle.step, exc)
            return
        s = handle.stats
        self.last_step = handle.step
        tier = job.tier if job.tier is not None else self.tiers.fastest
        # the chunk files gc frees are written over by the next save (store/files/staged.py
        # FreePool): the memory tier's once a save staged into it, a disk's in one process
        # (the ranks of a job share its files)
        for t in self.tiers.tiers:
            backend = t.store.backend
            pooled = job.ctx.direct and t is tier if t.name == "memory" else self.dist is None
            if pooled and hasattr(backend, "recycle_bytes"):
                backend.recycle_bytes = max(backend.recycle_bytes, s.total_bytes)
        self.journal.append("durable", tier=tier.name, **s.durable_fields())
        promotion = None
        if self.dist is None:  # distributed: rank 0 retains inside the commit
            later = not self.options.async_save
            promotion = self.after(handle.step, tier, job.manifest, later=later, fresh=fresh)
        # the save's cost to training runs until its promotion ended too (engine/runtime/meter.py)
        until = promotion.done if promotion is not None else None
        self.meter.durable(blocking_s=s.blocking_s, background_s=s.background_s, until=until)
        if self.options.async_save:
            self.governor.durable(blocking_s=s.blocking_s, background_s=s.background_s, until=until)
