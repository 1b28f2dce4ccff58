"""The Checkpointer: the public face of saving and restoring."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from flashckpt.dist.runtime import DistRuntime
from flashckpt.engine.context import build_context
from flashckpt.engine.fingerprint import Fingerprinter
from flashckpt.engine.handle import SaveHandle, SaveStats, as_save_error
from flashckpt.engine.hooks import StepGate, copy_unprotected, find_optimizers, protected_pointers
from flashckpt.engine.inflight import InFlight
from flashckpt.engine.lifecycle import RunMarker
from flashckpt.engine.load import load_step, restore_newest
from flashckpt.engine.meter import RunMeter
from flashckpt.engine.options import Options
from flashckpt.engine.preempt import EmergencySave, Preemption
from flashckpt.engine.promote import Promotion
from flashckpt.engine.save import Committer, SaveJob
from flashckpt.engine.staging import StagingPool
from flashckpt.engine.tiers import Tier, TierSet, build_tiers
from flashckpt.errors import ConfigError, FlashCkptError
from flashckpt.journal import JOURNAL_NAME, Journal
from flashckpt.policy.retention import RetentionPolicy, as_retention
from flashckpt.policy.save import SavePolicy, as_save_policy, step_based
from flashckpt.state.capture import Captured, capture
from flashckpt.store.backend import LocalBackend
from flashckpt.store.lock import WriterLock
from flashckpt.store.manifest import Manifest
from flashckpt.store.store import CheckpointStore

log = logging.getLogger(__name__)


class Checkpointer:
    """Save and restore training state; see the README for the whole story.

    ``save(step, state)`` returns a :class:`SaveHandle` (``staged`` and ``durable`` futures).
    With ``async_save=True`` it returns once the state is protected: at once when the state
    holds an optimizer (staging then overlaps forward/backward and the optimizer's next
    ``step()`` waits for it), otherwise when staged. ``restore(state)`` loads the newest valid
    checkpoint in place and returns its step (None when there is none).
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        async_save: bool = False,
        incremental: bool = True,
        compression: str | None = None,
        keep: RetentionPolicy | int | None = None,
        host_memory_budget: int | str = "4GiB",
        chunk_size: int | str = "32MiB",
        persist_workers: int = 0,
        on_busy: str = "wait",
        overlap: bool = True,
        fsync: bool = True,
        direct_io: bool = True,
        save_policy: SavePolicy | int | None = None,
        memory_tier: str | os.PathLike[str] | None = None,
        keep_memory: RetentionPolicy | int | None = None,
        remote: str | None = None,
        remote_options: Mapping[str, Any] | None = None,
        keep_remote: RetentionPolicy | int | None = None,
        promotion: Promotion | None = None,
        handle_sigterm: bool = False,
        grace_period_s: float = 30.0,
        emergency_save: EmergencySave | None = None,
        process_group: Any = None,
        dist_timeout_s: float = 300.0,
    ) -> None:
        self.options = Options.build(
            host_memory_budget=host_memory_budget,
            chunk_size=chunk_size,
            async_save=async_save,
            incremental=incremental,
            compression=compression,
            persist_workers=persist_workers,
            on_busy=on_busy,
            overlap=overlap,
            fsync=fsync,
            direct_io=direct_io,
        )
        self.keep = as_retention(keep)
        self.root = Path(root).expanduser().absolute()
        self.rank, self.world_size = 0, 1
        self._dist = DistRuntime.detect(  # torch.distributed: see dist/runtime.py
            process_group=process_group, timeout_s=dist_timeout_s, on_busy=on_busy, root=self.root
        )
        if self._dist is not None:
            self.rank, self.world_size = self._dist.rank, self._dist.world_size
        # the disk tier writes the aligned bulk of each chunk past the page cache (directio.py)
        self.store = CheckpointStore(
            LocalBackend(self.root, fsync=fsync, direct_io=self.options.direct_io and fsync)
        )
        self._lock = WriterLock(self.root, name=self._dist.lock_name if self._dist else "writer")
        self._lock.acquire()
        self.journal = Journal(
            self.root / JOURNAL_NAME, rank=self._dist.rank if self._dist else None
        )
        self._promotion = promotion or Promotion()
        self._inflight = InFlight()
        try:  # tiers (see engine/tiers.py): memory -> local (root) -> remote
            tiers = build_tiers(
                local=self.store,
                local_root=self.root,
                keep=self.keep,
                memory_tier=memory_tier,
                keep_memory=keep_memory,
                remote=remote,
                remote_options=remote_options,
                keep_remote=keep_remote,
                fsync=fsync,
                lock_name=self._dist.lock_name if self._dist else "writer",
                check_shared=self._dist.check_shared if self._dist else None,
            )
        except BaseException:
            self._lock.release()
            raise
        self._tiers = TierSet(
            tiers, journal=self.journal, promotion=self._promotion, extra_pins=self._inflight.pinned
        )
        self._save_tier: Tier = self._tiers.fastest
        self._committer: Committer = self._commit_local
        self._pool = StagingPool(
            budget_bytes=self.options.host_memory_budget_bytes, chunk_bytes=self.options.chunk_bytes
        )
        self._stager = ThreadPoolExecutor(1, thread_name_prefix="flashckpt-stage")
        self._workers = ThreadPoolExecutor(
            self.options.workers, thread_name_prefix="flashckpt-persist"
        )
        self._fingerprints: dict[tuple[Any, ...], tuple[tuple[int, int], str]] = {}
        self._fingerprinter = Fingerprinter() if incremental else None
        self._gate = StepGate(self._inflight.wait_staged)
        self._closed = False
        self.last_step: int | None = None
        self.save_policy = as_save_policy(save_policy)
        self._meter = RunMeter()
        self._marker = RunMarker(
            self.root, self.journal, name=self._lock.path.stem, primary=self.rank == 0
        )
        self._marker.start(self.store, self.save_policy)
        self._preempt: Preemption | None = None
        if handle_sigterm:  # see engine/preempt.py
            self._preempt = Preemption(
                grace_period_s=grace_period_s, emergency_save=emergency_save, journal=self.journal
            )
            self._preempt.follows = self._dist is not None and self.rank != 0
            self._preempt.install()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Wait until the last save is durable, release everything, raise a pending error."""
        if self._closed:
            return
        if self._preempt is not None and self._preempt.triggered:  # SIGTERM: bounded final work
            self._preempt.final_save(self, step=None, state=None)
        self._closed = True
        try:
            self._wait_current()
        finally:
            self._gate.remove()
            self._stager.shutdown(wait=True)
            self._workers.shutdown(wait=True)
            p = self._preempt
            preempted = p is not None and p.signal_t is not None
            self._tiers.close(p.time_left() if p and preempted else self._promotion.close_timeout_s)
            if self._preempt is not None:
                self._preempt.uninstall()
            self._marker.end(self.last_step)
            self._lock.release()
        self._raise_pending()

    def wait(self) -> None:
        """Block until the in-flight save (if any) is durable; raise its error."""
        self._wait_current()
        self._raise_pending()

    def wait_promoted(self, timeout_s: float | None = None) -> bool:
        """Block until the in-flight save is durable and every queued promotion to slower tiers
        finished (or gave up); False when ``timeout_s`` ran out first."""
        self._wait_current()
        self._stager.submit(lambda: None).result()  # its durable callback queued the promotion
        return self._tiers.promoter.drain(timeout_s)

    def steps(self) -> list[int]:
        """Committed steps in any tier, oldest first."""
        return self._tiers.steps()

    @property
    def preempted(self) -> bool:
        """True once SIGTERM arrived (``handle_sigterm=True``); see engine/preempt.py."""
        return self._preempt is not None and self._preempt.active

    def should_save(self, step: int) -> bool:
        """Call once per training step with the step just completed: True when the save policy
        (``save_policy=``) says this step should be saved. Measures step time as it goes."""
        if self.save_policy is None:
            raise ConfigError(
                "should_save() needs a save policy: Checkpointer(..., save_policy=100) saves every "
                "100 steps; flashckpt.policy.Auto(mtbf_s=...) picks the interval from measurements"
            )
        policy, preempt = self.save_policy, self._preempt
        # under torch.distributed, rank 0 decides whenever the ranks could disagree: clock-based
        # policies, and preemption (each rank receives SIGTERM at its own step)
        agree = self._dist is not None and (preempt is not None or not step_based(policy))
        if not agree and preempt is not None and preempt.at_should_save(self, step):
            return True
        now = time.time()
        self._marker.tick(step)
        step_time = self._meter.tick(step, now)
        if step_time is not None and self._meter.journal_due():
            self.journal.append("step_time", step=step, seconds=step_time)
        stats = self._meter.stats(step, now)
        if agree and self._dist is not None:
            if preempt is not None:
                preempt.last_step = step
            stop = preempt is not None and preempt.triggered  # only rank 0's counts
            verdict = self._dist.verdict(step, stop=stop, save=lambda: policy.should_save(stats))
            if verdict == "preempt" and preempt is not None:
                return preempt.follow(self, step)
            decision = verdict == "save"
        else:
            decision = policy.should_save(stats)
        info = policy.take_decision()
        if info:
            self.journal.append("interval", **info)
        return decision

    def save(self, step: int, state: Mapping[str, Any]) -> SaveHandle:
        """Checkpoint ``state`` as ``step``; see the class docstring for when it returns."""
        self._check_open()
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise ConfigError(f"step must be an int >= 0, got {step!r}")
        if self._preempt is not None:
            self._preempt.at_save(self, step, state)
        if self._dist is None:
            return self._save(step, state)
        self._dist.begin_save(step)  # dist: a failure before the job exists reaches every rank
        try:
            return self._save(step, state)
        except Exception as exc:
            agreed = self._dist.failed(exc)
            if agreed is exc:
                raise
            raise agreed from exc

    def _save(self, step: int, state: Mapping[str, Any]) -> SaveHandle:
        t0 = time.perf_counter()
        self._raise_pending()
        if self._inflight.busy():
            if self.options.on_busy == "skip":
                return self._skipped(step)
            self._inflight.wait_durable()  # counted in this save's blocking time
            self._raise_pending()
        captured = capture(state)
        if self._dist is not None:  # keep what this rank writes; per-rank keys renamed
            self._dist.split(captured, state)
        optimizers = find_optimizers(state) if self.options.async_save else []
        if optimizers and self.options.overlap:
            copy_unprotected(captured, protected_pointers(optimizers))
        handle = SaveHandle(step=step, stats=SaveStats(step=step))
        self._meter.saved(step, time.time())
        job = self._job(handle, captured)
        self.journal.append("save_start", step=step)
        if self.options.async_save:
            self._run_async(job, handle, wait_staged=not (optimizers and self.options.overlap))
            self._gate.install(optimizers)
        else:
            job.run()
            handle.error_delivered = True  # a synchronous save raises right here
            self._finish(handle, job)
        handle.add_blocking(time.perf_counter() - t0)
        self.journal.append("staged", step=step, blocking_s=handle.blocking_s)
        if not self.options.async_save:
            exc = handle.durable.exception()
            if exc is not None:
                raise as_save_error(exc, handle.step)
        return handle

    def _job(self, handle: SaveHandle, captured: Captured) -> SaveJob:
        if self._dist is not None:  # rank 0 picks the tier of every rank (dist/attempt.py)
            self._save_tier = self._dist.tier(self._tiers, captured.nbytes)
        else:
            self._save_tier = self._tiers.target(step=handle.step, nbytes=captured.nbytes)
        chunks, ctx = build_context(
            captured,
            self.options,
            store=self._save_tier.store,
            pool=self._pool,
            workers=self._workers,
            fingerprinter=self._fingerprinter,
            fingerprints=self._fingerprints,
            rank=self.rank,
            world_size=self.world_size,
        )
        if self._dist is not None:  # commit = parts + store barrier + rank 0 publishes
            retain = lambda: self._retain(handle.step)  # noqa: E731
            return self._dist.job(
                retain=retain, ctx=ctx, handle=handle, captured=captured, chunks=chunks
            )
        return SaveJob(
            ctx=ctx, handle=handle, captured=captured, chunks=chunks, committer=self._committer
        )

    def _run_async(self, job: SaveJob, handle: SaveHandle, *, wait_staged: bool) -> None:
        self._inflight.start(handle, job)
        handle.durable.add_done_callback(lambda _f: self._finish(handle, job))
        self._stager.submit(job.run)
        if wait_staged:
            try:
                handle.staged.result()
            except BaseException:
                pass

    def _skipped(self, step: int) -> SaveHandle:
        handle = SaveHandle(step=step, stats=SaveStats(step=step), skipped=True)
        self.journal.append("save_skipped", step=step, reason="previous save still persisting")
        handle.staged.set_result(handle.stats)
        handle.durable.set_result(handle.stats)
        return handle

    def _finish(self, handle: SaveHandle, job: SaveJob) -> None:
        """Runs when a save is durable or failed: journal, retention, gc, error bookkeeping."""
        exc = handle.durable.exception()
        if exc is not None:
            self._inflight.failed(handle, exc)
            self.journal.append("save_failed", step=handle.step, error=str(exc))
            log.error("checkpoint step %d failed: %s", handle.step, exc)
            return
        s = handle.stats
        self.last_step = handle.step
        self._meter.durable(blocking_s=s.blocking_s, background_s=s.background_s)
        self.journal.append("durable", tier=self._save_tier.name, **s.durable_fields())
        try:
            if self._dist is None:  # distributed: rank 0 retains inside the commit
                self._retain(handle.step, job.manifest)
        except FlashCkptError as exc:
            log.warning("retention after step %d failed: %s", handle.step, exc)

    def _retain(self, step: int, manifest: Manifest | None = None) -> None:
        """Queue promotion to the slower tiers, then apply the save tier's retention + gc."""
        self._tiers.committed(step, self._save_tier, manifest)  # None: read it back
        self._tiers.retain(self._save_tier)

    def _commit_local(self, manifest: Any, chunk_dirs: list[str]) -> None:
        self._save_tier.store.commit(manifest, chunk_dirs=chunk_dirs)

    def _wait_current(self) -> None:
        self._inflight.wait_durable()

    def _raise_pending(self) -> None:
        self._inflight.raise_pending()

    def _check_open(self) -> None:
        if self._closed:
            raise FlashCkptError("this Checkpointer is closed; create a new one")

    def restore(
        self, state: Mapping[str, Any], step: int | None = None, *, strict: bool = True
    ) -> int | None:
        """Load the newest valid checkpoint (or ``step``) into ``state`` in place.

        Returns the step loaded, or None when there is no checkpoint. A damaged checkpoint is
        skipped with a warning and a journal entry when ``step`` is None; with an explicit
        ``step`` it raises :class:`CorruptCheckpointError` naming the key and chunk.
        """
        self._check_open()
        self._wait_current()
        holders = self._tiers.holders()  # every tier's copies, fastest first (engine/tiers.py)
        if self._dist is not None:  # every rank loads the same step (dist/restore.py)
            return self._dist.restore(
                self.store,
                self.journal,
                state,
                step=step,
                steps=sorted(holders),
                load=lambda s: self._tiers.restore(
                    s, holders.get(s, []), lambda t: self._restore_step(state, s, strict, t)
                ),
            )
        return restore_newest(
            holders,
            step,
            lambda s, t: self._restore_step(state, s, strict, t),
            self._tiers.restore,
        )

    def _restore_step(self, state: Mapping[str, Any], step: int, strict: bool, tier: Tier) -> None:
        load_step(
            state,
            step,
            tier,
            strict=strict,
            rank=self.rank,
            readers=self.options.readers,
            journal=self.journal,
        )
        self.last_step = step
        self._meter.saved(step, time.time())
        self._marker.restored(step)
