"""The Checkpointer: the public face of saving and restoring."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping
from contextlib import ExitStack
from functools import partial
from pathlib import Path
from typing import Any

from flashckpt.distributed.runtime import DistRuntime
from flashckpt.engine.gcpause import paused_gc
from flashckpt.engine.options import Options, Replication, check_step
from flashckpt.engine.restore.lineage import open_branch, owned_memory
from flashckpt.engine.restore.load import Attempt, restore_from_tiers
from flashckpt.engine.runtime import exit as exits
from flashckpt.engine.runtime import takeover
from flashckpt.engine.runtime.cadence import decide
from flashckpt.engine.runtime.inflight import InFlight
from flashckpt.engine.runtime.lifecycle import RunMarker
from flashckpt.engine.runtime.meter import RunMeter
from flashckpt.engine.runtime.preempt import EmergencySave, Preemption
from flashckpt.engine.runtime.saving import SavePath
from flashckpt.engine.save.handle import SaveHandle
from flashckpt.engine.save.steps import holding
from flashckpt.engine.tiers.arena import arena_for
from flashckpt.engine.tiers.build import build_tiers, release_locks
from flashckpt.engine.tiers.closing import close_tiers
from flashckpt.engine.tiers.promote import Promotion
from flashckpt.engine.tiers.scrubbing import start_idle_scrub
from flashckpt.engine.tiers.tierset import TierSet
from flashckpt.errors import ConfigError, FlashCkptError
from flashckpt.journal import JOURNAL_NAME, Journal
from flashckpt.policy.retention import RetentionPolicy, as_retention
from flashckpt.policy.save import SavePolicy, as_save_policy
from flashckpt.store.files.backend import LocalBackend
from flashckpt.store.lock import WriterLock
from flashckpt.store.store import CheckpointStore

log = logging.getLogger(__name__)


def _promotion(promotion: Promotion | None, replication: Replication | None) -> Promotion:
    p = promotion or Promotion()
    if p.every > 1 and replication is not None:
        raise ConfigError(
            "Promotion(every=) > 1 does not work with replicas= yet (a replication round "
            "promotes every replicated step to the disk tier); use one or the other"
        )
    return p


class Checkpointer:
    """Save and restore training state; docs/guides/integration.md tells the whole story.

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
        governor: bool = True,
        save_budget_s: float | None = None,
        scrub_bytes_per_s: int | str = "64MiB",
        save_policy: SavePolicy | int | None = None,
        memory_tier: str | os.PathLike[str] | None = None,
        keep_memory: RetentionPolicy | int | None = None,
        keep_memory_after_close: bool = False,
        remote: str | None = None,
        remote_options: Mapping[str, Any] | None = None,
        keep_remote: RetentionPolicy | int | None = None,
        promotion: Promotion | None = None,
        handle_sigterm: bool = False,
        grace_period_s: float = 30.0,
        emergency_save: EmergencySave | None = None,
        process_group: Any = None,
        dist_timeout_s: float = 300.0,
        replicas: int | Replication = 0,
    ) -> None:
        self._closed = True  # until __init__ succeeds: close() and the exit hook do nothing
        self._standby: takeover.Pending | None = None
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
            governor=governor,
            save_budget_s=save_budget_s,
            scrub_bytes_per_s=scrub_bytes_per_s,
        )
        self.keep = as_retention(keep)
        self.save_policy = as_save_policy(save_policy)
        self._empty_memory = not keep_memory_after_close  # see engine/tiers/closing.py
        self.root = Path(root).expanduser().absolute()
        self.rank, self.world_size = 0, 1
        self._replication = Replication.of(replicas)  # peer copies of the memory tier
        self._promotion = _promotion(promotion, self._replication)
        opening = partial(
            self._open,
            dist=dict(process_group=process_group, timeout_s=dist_timeout_s, on_busy=on_busy),
            fsync=fsync,
            tiers=dict(
                memory_tier=memory_tier,
                keep_memory=keep_memory,
                remote=remote,
                remote_options=remote_options,
                keep_remote=keep_remote,
            ),
            run=(handle_sigterm, grace_period_s, emergency_save),
        )
        # a warm standby (flashckpt run --standby 1) opens nothing until it takes over
        self._standby = takeover.pending(opening)
        if self._standby is None:
            opening()

    def _open(
        self,
        *,
        dist: dict[str, Any],
        fsync: bool,
        tiers: dict[str, Any],
        run: tuple[bool, float, EmergencySave | None],
    ) -> None:
        """Open the root, the tiers and the runtime (at once, or at a standby's takeover)."""
        # torch.distributed: see distributed/runtime.py
        self._dist = DistRuntime.detect(**dist, root=self.root, replication=self._replication)
        if self._dist is not None:
            self.rank, self.world_size = self._dist.rank, self._dist.world_size
        with ExitStack() as undo:  # any failure below releases what was taken so far
            self._open_root(undo, fsync=fsync)
            self._open_tiers(undo, fsync=fsync, **tiers)
            # the run generation, once every rank's tiers are known to be shared
            self._branch = open_branch(self.root, self.store, self._dist)
            self._start_runtime()
            undo.callback(self._stop_threads)
            self._start_run(*run)
            undo.pop_all()
        self._closed = False
        exits.track(self)

    def _open_root(self, undo: ExitStack, *, fsync: bool) -> None:
        """The disk tier's store, the root's writer lock (one per rank), the journal."""
        # the disk tier writes the aligned bulk of each chunk past the page cache
        direct = self.options.direct_io and fsync
        self.store = CheckpointStore(LocalBackend(self.root, fsync=fsync, direct_io=direct))
        self._lock = WriterLock(self.root, name=self._lock_name)
        self._lock.acquire()
        undo.callback(self._lock.release)
        self.journal = Journal(self.root / JOURNAL_NAME, rank=self.rank if self._dist else None)
        self._inflight = InFlight()

    @property
    def _lock_name(self) -> str:
        return self._dist.lock_name if self._dist else "writer"

    def _open_tiers(self, undo: ExitStack, *, fsync: bool, **tier_args: Any) -> None:
        """memory -> local (root) -> remote (engine/tiers/build.py), their TierSet and, under
        peer replication, the replication thread (distributed/replication/replicate.py)."""
        tiers = build_tiers(
            local=self.store,
            local_root=self.root,
            keep=self.keep,
            fsync=fsync,
            lock_name=self._lock_name,
            check_shared=self._dist.check_shared if self._dist else None,
            **tier_args,
        )
        undo.callback(release_locks, tiers)
        self._tiers = TierSet(
            tiers, journal=self.journal, promotion=self._promotion, extra_pins=self._inflight.pinned
        )
        undo.callback(self._tiers.promoter.stop)
        if self._dist is not None:
            self._dist.start(self._tiers, self.journal)
            undo.callback(self._dist.stop)

    def _start_run(
        self, handle_sigterm: bool, grace_period_s: float, emergency_save: EmergencySave | None
    ) -> None:
        """The run marker (restarts, the steps a crash lost) and the SIGTERM handler."""
        self._marker = RunMarker(
            self.root, self.journal, name=self._lock.path.stem, primary=self.rank == 0
        )
        self._marker.start(self.store, self.save_policy, self._saver.governor)
        self._preempt: Preemption | None = None
        if handle_sigterm:  # see engine/runtime/preempt.py
            self._preempt = Preemption(
                grace_period_s=grace_period_s, emergency_save=emergency_save, journal=self.journal
            )
            self._preempt.follows = self._dist is not None and self.rank != 0
            self._preempt.install()

    def _start_runtime(self) -> None:
        """The save path (engine/runtime/saving.py: staging pool, stager and persist threads) and
        the warm-up that readies its threads, chunk directories and arena before the first save."""
        self._meter = RunMeter()
        self._saver = SavePath(
            options=self.options,
            tiers=self._tiers,
            journal=self.journal,
            inflight=self._inflight,
            meter=self._meter,
            dist=self._dist,
            rank=self.rank,
            world_size=self.world_size,
            arena=arena_for(self._tiers.fastest, name=self._lock_name),  # engine/tiers/arena.py
            lineage=self._branch.lineage,  # recorded in every manifest
        )
        sv = self._saver
        self._pool, self._workers, self._after = sv.pool, sv.workers, sv.after
        self._warmup = sv.start_warmup()
        gov = sv.governor
        start_idle_scrub(  # one scrubber per tier (engine/tiers/scrubbing.py)
            self._tiers,
            bytes_per_s=self.options.scrub_bytes_per_s,
            busy=self._inflight.busy,
            saturated=gov.idle_work_waits,  # a saturated host or no idle core
            owned=self._dist.owns if self._dist is not None else None,
        )

    def _stop_threads(self) -> None:
        self._warmup.stop()
        self._saver.stop()

    @property
    def last_step(self) -> int | None:
        """The newest step this Checkpointer made durable or restored (None: neither yet)."""
        return None if self._standby is not None else self._saver.last_step

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Wait until the last save is durable, release everything, raise a pending error."""
        if self._standby is not None:  # a standby that never took over opened nothing
            self._standby = None
            return
        if self._closed:
            return
        if self._preempt is not None and self._preempt.triggered:  # SIGTERM: bounded final work
            self._preempt.final_save(self, step=None, state=None)
        self._closed = True
        exits.untrack(self)
        try:
            self._wait_current()
        finally:
            self._stop_threads()
            p = self._preempt
            close_tiers(  # engine/tiers/closing.py
                self._tiers,
                self.journal,
                dist=self._dist,
                empty=self._empty_memory,
                timeout_s=self._promotion.close_timeout_s,
                preempted_left_s=p.time_left if p is not None and p.signal_t is not None else None,
            )
            if self._preempt is not None:
                self._preempt.uninstall()
            self._marker.end(self.last_step)
            self._lock.release()
        self._raise_pending()

    def at_exit(self, wait_s: float) -> None:
        """The process is exiting without ``close()`` (engine/runtime/exit.py): finish the save in
        flight, or journal and log that it was abandoned. Locks die with the process."""
        if self._closed:
            return
        if exits.finish_in_flight(self._inflight, self.journal, wait_s):
            self._saver.settle()  # its durable callback has run
            self._tiers.promote_deferred()
            self._tiers.promoter.drain(self._promotion.close_timeout_s)

    def has_step(self, step: int) -> bool:
        """True when ``step`` is committed in any tier (a step is saved once: see save())."""
        self._take_over()
        return bool(holding(self._tiers.tiers, step))

    def wait(self) -> None:
        """Block until the in-flight save (if any) is durable; raise its error."""
        self._take_over()
        self._wait_current()
        self._saver.settle()
        self._raise_pending()

    def wait_promoted(self, timeout_s: float | None = None) -> bool:
        """Block until the in-flight save is durable and every queued promotion to slower tiers
        finished (or gave up); False when ``timeout_s`` ran out first."""
        self._take_over()
        self._wait_current()
        self._saver.settle()  # its durable callback queued the promotion
        return self._tiers.promoter.drain(timeout_s)

    def steps(self) -> list[int]:
        """Committed steps in any tier, oldest first (after the last save's retention)."""
        self._take_over()
        self._after.wait()
        return self._tiers.steps()

    @property
    def preempted(self) -> bool:
        """True once SIGTERM arrived (``handle_sigterm=True``); see engine/runtime/preempt.py."""
        return self._preempt is not None and self._preempt.active

    def should_save(self, step: int) -> bool:
        """Call once per training step with the step just completed: True when the save policy
        (``save_policy=``) says this step should be saved. Measures step time as it goes."""
        self._take_over()
        return decide(self, step, self._meter, self._marker, self._dist, self._preempt)

    def step(self, step: int) -> None:
        """Record that training reached ``step``: a small write to the run marker (page cache,
        no fsync) and the step-time meter. Call it every step when the loop does not call
        ``should_save`` every step, so the steps a crash loses are measured."""
        self._take_over()
        check_step(step)
        self._marker.tick(step)
        step_time = self._meter.tick(step, time.time())
        if step_time is not None and self._meter.journal_due():  # for the report's lost time
            self.journal.append("step_time", step=step, seconds=step_time)

    def save(self, step: int, state: Mapping[str, Any]) -> SaveHandle:
        """Checkpoint ``state`` as ``step``; see the class docstring for when it returns."""
        self._check_open()
        check_step(step)
        self._marker.tick(step)  # the furthest step reached, also without should_save/step
        if self._preempt is not None:
            self._preempt.at_save(self, step, state)
        if self._dist is None:
            return self._saver.save(step, state)
        # a failure before the job exists still reaches every rank (distributed/runtime.py)
        return self._dist.run_save(step, lambda: self._saver.save(step, state))

    def _wait_current(self) -> None:
        self._saver.wait_durable()

    def _raise_pending(self) -> None:
        self._inflight.raise_pending()

    def _take_over(self) -> None:
        """A standby's first use waits for its takeover, then opens (engine/runtime/takeover.py)."""
        if self._standby is not None:
            pending, self._standby = self._standby, None
            takeover.take_over(pending, self)

    def _check_open(self) -> None:
        self._take_over()
        if self._closed:
            raise FlashCkptError("this Checkpointer is closed; create a new one")

    def restore(
        self, state: Mapping[str, Any], step: int | None = None, *, strict: bool = True
    ) -> int | None:
        """Load the newest valid checkpoint (or ``step``) into ``state`` in place.

        Returns the step loaded, or None when there is no checkpoint (the state is then
        untouched). A damaged checkpoint is skipped with a warning and a journal entry when
        ``step`` is None; with an explicit ``step`` it raises :class:`CorruptCheckpointError`
        naming the key and chunk. When no checkpoint loads after bytes already reached the
        live state, it raises :class:`CorruptCheckpointError` saying so, never returns None.
        A step written by a newer flashckpt raises :class:`UnsupportedFormatError` (not damage:
        it is not skipped for an older step).
        """
        self._check_open()
        self._marker.restoring()  # times a restart (engine/runtime/restart.py)
        self._wait_current()
        attempt = Attempt()
        try:  # the plan makes a few objects per tensor: no full collections meanwhile
            with paused_gc():
                got = restore_from_tiers(
                    state,
                    step,
                    tiers=self._tiers,
                    store=self.store,
                    dist=self._dist,
                    journal=self.journal,
                    strict=strict,
                    rank=self.rank,
                    readers=self.options.readers,
                    attempt=attempt,
                    branch=self._branch,
                    owned=owned_memory(self._tiers, self.rank if self._dist else None),
                )
        finally:  # a step damaged in every tier may be saved again (engine/save/steps.py)
            self._saver.damaged |= attempt.damaged
        if got is not None:
            self._restored(got)
        return got

    def _restored(self, step: int) -> None:
        self._saver.last_step = step
        self._meter.saved(step, time.time(), started=False)
        self._marker.restored(step)
