"""Promotion: copy committed checkpoints to slower tiers in the background.

One thread (owned here, started lazily) takes promotion tasks in order. For each slower tier
that wants the step (its retention policy would keep it and it does not hold it yet) it copies
the chunks the tier lacks (by hash, several at once; each chunk is read back and verified
first, so a damaged copy never spreads: :mod:`flashckpt.engine.tiers.tiercopy`), then writes the
manifest last, then applies that tier's retention. Every
chunk of a queued or running task is pinned (:meth:`flashckpt.store.liveness.Liveness.pin`, in
memory and on disk), so no garbage collection deletes it even if the source tier's retention
already dropped the step; the pin goes when the task ends or is dropped, and the source tier is
collected then.

The queue is bounded (``Promotion.max_queued`` tasks waiting, plus the one being copied), so a
slow disk or remote can never make the memory tier hold more than its retention plus those
steps. When it is full, ``on_full="wait"`` (default) makes the next save wait for room (every
step is promoted; training slows to the slower tier's pace), and ``on_full="skip"`` drops the
oldest waiting step instead (journaled as ``promote_skipped``, naming the newer step that
replaced it; the skipped step stays in the faster tier until its retention drops it).

Failures never reach training: they are logged, journaled as ``promote_failed`` and retried
with exponential backoff; after ``Promotion.retries`` attempts the tier is skipped for that step
(``promote_abandoned``). A damaged source chunk is journaled as ``corrupt`` and not retried.

While nothing is queued the thread does the idle work it was given (:meth:`Promoter.idle_work`:
the scrub of engine/tiers/scrubbing.py), one bounded step at a time, at the pace it asks for.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from flashckpt.engine.tiers.tiercopy import ChunkCopier, Fresh, PromotionStopped, copy_step, started
from flashckpt.errors import ConfigError, CorruptCheckpointError
from flashckpt.journal import Journal
from flashckpt.store.format.manifest import Manifest
from flashckpt.store.pins import Pin

if TYPE_CHECKING:
    from flashckpt.engine.tiers.build import Tier

log = logging.getLogger(__name__)


class IdleWork(Protocol):
    """Work for the promotion thread's idle time (engine/tiers/scrubbing.py IdleScrub)."""

    def __call__(self) -> float:
        """One bounded step; returns the seconds until the next."""
        ...

    def activity(self) -> None:
        """A promotion just ran."""
        ...


@dataclass(frozen=True, kw_only=True)
class Promotion:
    """How background promotion retries and how long ``close()`` waits for it.

    ``workers``: chunks copied at once (each keeps a chunk-sized buffer). ``retries``:
    attempts per step and tier; the k-th wait is
    ``min(max_backoff_s, backoff_s * 2**k)``. ``close_timeout_s``: the most ``close()`` waits for
    queued promotions (None: until they finish or give up); what is left is journaled as
    ``promote_abandoned`` and stays in the faster tier. ``max_queued``: steps waiting for
    promotion (besides the one being copied); ``on_full``: ``"skip"`` drops the oldest waiting
    step when a newer one arrives, ``"wait"`` (default) makes the newer one wait for room.
    ``stop_timeout_s``: how long ``close()`` waits for the copy in progress to stop.
    ``every``: promote only every ``every``-th step committed in the fastest tier (the first
    one of each process, then every ``every``-th; ``close()`` always promotes the newest one).
    The others live in the fastest tier only: a memory-tier step survives the process
    crashing, not the node, so ``every=10`` with the memory tier trades node-loss protection
    at a tenth of the checkpoints for a save that costs training only its memory copy. It
    counts saves, not seconds, so the ranks of a distributed job promote the same steps.
    """

    retries: int = 8
    workers: int = 4
    backoff_s: float = 1.0
    max_backoff_s: float = 60.0
    close_timeout_s: float | None = None
    max_queued: int = 2
    on_full: str = "wait"
    stop_timeout_s: float = 120.0
    every: int = 1

    def __post_init__(self) -> None:
        e = self.every
        if not isinstance(e, int) or isinstance(e, bool) or e < 1:
            raise ConfigError(f"Promotion(every=) must be an int >= 1, got {e!r}")
        if not isinstance(self.retries, int) or self.retries < 1:
            raise ConfigError(f"Promotion(retries=) must be an int >= 1, got {self.retries!r}")
        if not isinstance(self.workers, int) or isinstance(self.workers, bool) or self.workers < 1:
            raise ConfigError(f"Promotion(workers=) must be an int >= 1, got {self.workers!r}")
        if self.backoff_s < 0 or self.max_backoff_s < self.backoff_s:
            raise ConfigError("Promotion needs 0 <= backoff_s <= max_backoff_s")
        if self.close_timeout_s is not None and self.close_timeout_s < 0:
            raise ConfigError("Promotion(close_timeout_s=) must be >= 0 or None")
        q = self.max_queued
        if not isinstance(q, int) or isinstance(q, bool) or q < 1:
            raise ConfigError(f"Promotion(max_queued=) must be an int >= 1, got {q!r}")
        if self.on_full not in ("skip", "wait"):
            raise ConfigError(f"Promotion(on_full=) must be 'skip' or 'wait', not {self.on_full!r}")
        if self.stop_timeout_s < 0:
            raise ConfigError("Promotion(stop_timeout_s=) must be >= 0")


@dataclass(kw_only=True)
class PromoteTask:
    step: int
    src: Tier
    manifest: Manifest
    dsts: list[Tier]
    queued_t: float
    pin: Pin  # the source step's chunks, until the task ends or is dropped
    done: threading.Event = field(default_factory=threading.Event)  # ended, or dropped
    # the pages of the chunks its save just wrote, still mapped; closed when the task ends
    fresh: Fresh | None = None


class Promoter:
    """The promotion thread. ``wants(dst, step)`` and ``after(dst)`` come from the TierSet."""

    def __init__(
        self,
        *,
        options: Promotion,
        journal: Journal,
        wants: Callable[[Tier, int], bool],
        after: Callable[[Tier], None],
        release: Callable[[PromoteTask], None],
    ) -> None:
        self.options = options
        self.journal = journal
        self._wants = wants
        self._after = after
        self._release_cb = release
        self._queue: deque[PromoteTask] = deque()
        self._cv = threading.Condition()
        self._busy = False
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._copier = ChunkCopier(options.workers)
        self._idle: IdleWork | None = None
        self._idle_at = 0.0  # time.monotonic() of the next idle step
        self._thread_start: Callable[[], None] | None = None
        # entered while someone waits for this thread and its copy threads (the runtime runs
        # them at the foreground level meanwhile: engine/runtime/priority.py)
        self._waited_on: Callable[[], AbstractContextManager[object]] = nullcontext

    def idle_work(self, work: IdleWork) -> None:
        """Run ``work`` whenever no promotion is queued (starts the thread)."""
        with self._cv:
            if self._stopping:
                return
            self._idle, self._idle_at = work, time.monotonic()
            self._start()
            self._cv.notify_all()

    def on_thread_start(self, hook: Callable[[], None]) -> None:
        """Run ``hook`` first on the promotion thread and on every copy thread it starts (the
        runtime sets the background CPU level there: engine/runtime/priority.py). Set before
        the thread starts (the Checkpointer does, as it builds the save path)."""
        self._copier.thread_start = hook
        self._thread_start = hook

    def on_wait(self, waited_on: Callable[[], AbstractContextManager[object]]) -> None:
        """Enter ``waited_on()`` whenever a caller waits for the promotion (room in a full
        queue, :meth:`drain`): the runtime raises the promotion threads' CPU level there."""
        self._waited_on = waited_on

    def _start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="flashckpt-promote", daemon=True)
            self._thread.start()

    def submit(self, task: PromoteTask) -> None:
        """Queue ``task`` (its chunks are pinned already); see the module docstring for what
        happens when the queue is full."""
        dropped: list[PromoteTask] = []
        with self._cv:
            if self.options.on_full == "wait":
                self._wait_for_room()
            while len(self._queue) >= self.options.max_queued and not self._stopping:
                dropped.append(self._queue.popleft())
            closed = self._stopping
            if not closed:
                self._queue.append(task)
                self._start()
                self._cv.notify_all()
        for old in dropped:
            self._skipped(old, newer=task.step)
        if closed:
            self._abandon(task)

    def _skipped(self, task: PromoteTask, *, newer: int) -> None:
        self.journal.append(
            "promote_skipped",
            step=task.step,
            src=task.src.name,
            newer=newer,
            reason=f"promotion fell behind (more than {self.options.max_queued} steps waiting)",
        )
        log.warning(
            "promotion fell behind: step %d is not promoted (step %d replaces it); it stays in "
            "%s until that tier's retention drops it",
            task.step,
            newer,
            task.src.url,
        )
        self._release(task)

    def _abandon(self, task: PromoteTask) -> None:
        self.journal.append("promote_abandoned", step=task.step, src=task.src.name, reason="closed")
        log.warning(
            "promotion of step %d from %s abandoned at close; it stays in %s",
            task.step,
            task.src.name,
            task.src.url,
        )
        self._release(task)

    def _release(self, task: PromoteTask) -> None:
        if task.fresh is not None:
            task.fresh.close()
        try:
            self._release_cb(task)
        except Exception as exc:  # never let the promotion thread die on it
            log.warning("releasing the pins of step %d failed: %s", task.step, exc)
        finally:
            task.done.set()

    def pending(self) -> list[int]:
        with self._cv:
            return [t.step for t in self._queue]

    def drain(self, timeout_s: float | None) -> bool:
        """Wait until every queued promotion finished; False on timeout."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._cv:
            if not (self._queue or self._busy):
                return True
            with self._waited_on():
                while self._queue or self._busy:
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        return False
                    self._cv.wait(left)
        return True

    def _wait_for_room(self) -> None:
        """(Under the lock.) ``on_full="wait"``: until the queue has room or the thread stops."""
        if len(self._queue) < self.options.max_queued or self._stopping:
            return
        with self._waited_on():
            while len(self._queue) >= self.options.max_queued and not self._stopping:
                self._cv.wait(1.0)

    def stop(self) -> bool:
        """Stop after the chunk being copied; drop (and journal) what is still queued. True
        when the thread has ended (waits up to ``Promotion.stop_timeout_s``)."""
        with self._cv:
            self._stopping = True
            dropped = list(self._queue)
            self._queue.clear()
            self._cv.notify_all()
        for task in dropped:
            self._abandon(task)
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=self.options.stop_timeout_s)
        stopped = thread is None or not thread.is_alive()
        if stopped:
            self._copier.close()
        return stopped

    # -- the thread -------------------------------------------------------------------------
    def _run(self) -> None:
        started(self._thread_start)
        while True:
            idle = None
            with self._cv:
                while not self._queue and not self._stopping:
                    left = None if self._idle is None else self._idle_at - time.monotonic()
                    if left is not None and left <= 0:
                        idle = self._idle
                        break
                    self._cv.wait(left)
                if self._stopping:
                    return
                if idle is None:
                    task = self._queue.popleft()
                    self._busy = True
                    self._cv.notify_all()  # a submit waiting for room (on_full="wait")
            if idle is not None:
                self._run_idle(idle)
                continue
            try:
                for dst in task.dsts:
                    self._promote_to(task, dst)
            except BaseException as exc:  # never let the thread die silently
                log.exception("promotion of step %d failed: %s", task.step, exc)
            finally:
                self._release(task)
                with self._cv:
                    self._busy = False
                    if self._idle is not None:
                        self._idle.activity()
                    self._cv.notify_all()

    def _run_idle(self, idle: IdleWork) -> None:
        try:
            delay = idle()
        except Exception as exc:  # never let the thread die on it; try again much later
            log.exception("idle work of the promotion thread failed: %s", exc)
            delay = 60.0
        with self._cv:
            self._idle_at = time.monotonic() + max(0.0, delay)

    def _promote_to(self, task: PromoteTask, dst: Tier) -> None:
        for attempt in range(self.options.retries):
            if self._stopping:
                return
            try:
                dst.claim()  # a remote's root id, if it could not be checked at start
                if not self._wants(dst, task.step):
                    return
                t0 = time.perf_counter()
                stop = lambda: self._stopping  # noqa: E731
                nbytes, nchunks = copy_step(
                    task.src, dst, task.manifest, self._copier, stop=stop, fresh=task.fresh
                )
            except PromotionStopped:
                self.journal.append(
                    "promote_abandoned", step=task.step, src=task.src.name, reason="closed"
                )
                return
            except CorruptCheckpointError as exc:
                self.journal.append("corrupt", step=task.step, tier=task.src.name, error=str(exc))
                log.error("not promoting damaged step %d from %s: %s", task.step, task.src.url, exc)
                return
            except Exception as exc:
                if not self._retry_later(task, dst, attempt, exc):
                    return
                continue
            self._done(task, dst, time.perf_counter() - t0, nbytes, nchunks)
            return

    def _done(self, task: PromoteTask, dst: Tier, seconds: float, nbytes: int, n: int) -> None:
        self.journal.append(
            "promoted",
            step=task.step,
            src=task.src.name,
            dst=dst.name,
            seconds=seconds,
            bytes=nbytes,
            chunks=n,
            since_queued_s=time.time() - task.queued_t,
        )
        log.info("step %d promoted %s -> %s (%d bytes)", task.step, task.src.name, dst.name, nbytes)
        try:
            self._after(dst)
        except Exception as exc:
            log.warning("retention on tier %s after promotion failed: %s", dst.name, exc)

    def _retry_later(self, task: PromoteTask, dst: Tier, attempt: int, exc: Exception) -> bool:
        last = attempt + 1 >= self.options.retries
        delay = min(self.options.max_backoff_s, self.options.backoff_s * (2**attempt))
        self.journal.append(
            "promote_abandoned" if last else "promote_failed",
            step=task.step,
            src=task.src.name,
            dst=dst.name,
            attempt=attempt + 1,
            error=f"{type(exc).__name__}: {exc}",
            retry_in_s=None if last else delay,
        )
        if last:
            log.error(
                "giving up promoting step %d to %s after %d attempts: %s; it stays in %s",
                task.step,
                dst.url,
                attempt + 1,
                exc,
                task.src.url,
            )
            return False
        log.warning(
            "promoting step %d to %s failed (%s); retrying in %.1fs", task.step, dst.url, exc, delay
        )
        with self._cv:
            self._cv.wait_for(lambda: self._stopping, timeout=delay)
        return not self._stopping
