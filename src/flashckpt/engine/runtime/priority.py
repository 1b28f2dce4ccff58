"""The CPU priority of a Checkpointer's background threads, set per thread by the governor.

While a save runs in the background its threads (the stager, the persist workers) compete
with the training loop for the cores; while it runs in the foreground the loop waits for them.
So each thread registers itself when it starts, and the governor moves them all between two
levels:

* **background** (training runs beside them): ``SCHED_BATCH``, which the kernel treats as
  CPU-bound work that never preempts a waking task, so a training thread that wakes (a kernel
  launch returns, a data-loader batch lands) runs at once; and, where this process may lower
  a thread's nice value again (root, CAP_SYS_NICE, or an ``RLIMIT_NICE`` that allows nice 0),
  nice 10 as well, which gives the thread about a tenth of a core's share when it contends with
  a nice-0 training thread.
* **foreground** (the loop waits): ``SCHED_OTHER`` at nice 0, so the save finishes as fast as
  the host allows.

Whenever the loop waits for the save's threads they run at the foreground level for as long as
it waits (:meth:`ThreadPriority.waited_on`), whatever level the governor gave them: a thread the
loop waits for never runs at the level meant for work beside it (busy processes on the cores
took nine tenths of each core from it while the loop stood still). Every wait for a save goes
through its handle's futures (engine/save/handle.py, :class:`Outcome`), which hold this hook:
the optimizer hook waiting for staging, ``save()`` waiting for the save in flight or for its own
staging, ``close``/``restore``/``wait``, the exit handler, and the caller's own
``handle.wait()``, ``handle.staged.result()`` or ``.exception()``. Waits may overlap (another
thread waiting on a handle); the threads go back when the last one ends.

Threads whose work no save waits for (promotion to the slower tiers and its copy threads,
the idle scrub on the promotion thread, the warm-up) register with
:meth:`ThreadPriority.register_background` and stay at the background level whatever the
save's threads do. Before, they ran at nice 0 beside training: on the 2-core CI VM, with a
memory tier, a one-thread training loop waited 14-18 ms per 256 MiB save for a CPU the
promotion held, 2-4 ms since (``benchmarks/save_waits.py``; BENCHMARKS.md, "What a save costs
the training loop").
The same rule holds for them: while something waits for them (a save waiting for room in the
promotion queue, ``close`` or ``wait_promoted`` draining it) they run at the foreground level
(:meth:`ThreadPriority.background_waited_on`).

An unprivileged process can move a thread from ``SCHED_BATCH`` back to ``SCHED_OTHER`` but not
raise its nice value back (nor leave ``SCHED_IDLE``): it gets ``SCHED_BATCH`` alone rather than a
level it could not undo. Where the calls do not exist (not Linux) or are refused, every call
is a no-op; ``level`` then says ``"unmanaged"``.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from flashckpt.engine.cpupolicy import BATCH, OTHER, may_raise_priority

BACKGROUND_NICE = 10


@dataclass(kw_only=True)
class ThreadPriority:
    """The registered background threads and the level they run at (see the module doc)."""

    use_nice: bool = field(default_factory=may_raise_priority)
    level: str = "background"  # the governor's level (the threads run at it while no one waits)
    # thread ids are reused by the kernel once a thread ended: each is kept with its Thread and
    # touched only while that thread is alive (else a later, unrelated thread with the same id,
    # the training thread even, would be moved)
    _tids: dict[int, threading.Thread] = field(default_factory=dict)
    _always: set[int] = field(default_factory=set)  # registered with register_background
    _raised: int = 0  # waits on the background-only threads in progress (background_waited_on)
    _waits: int = 0  # waits on the save's threads in progress (waited_on)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _works: bool = BATCH is not None and hasattr(os, "sched_setscheduler")

    def register(self) -> None:
        """Called by each background thread as it starts (a pool's ``initializer``)."""
        tid = threading.get_native_id()
        with self._lock:
            self._tids[tid] = threading.current_thread()
            self._always.discard(tid)  # (an id an ended background-only thread had)
            self._apply(tid, self._levels()[False])

    def register_background(self) -> None:
        """Called as it starts by a thread whose work no save ever waits for (promotion to the
        slower tiers and its copy threads, the idle scrub, the warm-up): it runs at the
        background level for good, whatever level :meth:`set` gives the save's threads, and
        whether saves are asynchronous or not (the loop goes on while it works either way)."""
        tid = threading.get_native_id()
        with self._lock:
            self._tids[tid] = threading.current_thread()
            self._always.add(tid)
            self._apply(tid, self._levels()[True])

    def set(self, level: str) -> None:
        """The level the governor gives the save's threads (``background`` or
        ``foreground``); they move there now, or when the last wait on them ends."""
        with self._changing():
            self.level = level

    def waited(self) -> bool:
        """Whether the save's threads run at the foreground level now: something waits for
        them, or the governor runs the save in the foreground (engine/save/copier.py then
        copies on every core)."""
        return self._levels()[False] == "foreground"

    @contextmanager
    def waited_on(self) -> Iterator[None]:
        """The loop waits for the save's threads: at the foreground level meanwhile, then at
        the governor's level again once no one waits (see the module)."""
        with self._changing():
            self._waits += 1
        try:
            yield
        finally:
            with self._changing():
                self._waits -= 1

    @contextmanager
    def background_waited_on(self) -> Iterator[None]:
        """Something waits for the background-only threads (a save waiting for room in the
        promotion queue, ``close`` or ``wait_promoted`` draining it): they run at the
        foreground level meanwhile. Waits may overlap; the last one to end moves them back."""
        with self._changing():
            self._raised += 1
        try:
            yield
        finally:
            with self._changing():
                self._raised -= 1

    def _levels(self) -> tuple[str, str]:
        """The level of the save's threads and of the background-only ones (index: whether
        a thread is background-only): the foreground while someone waits for them."""
        return (
            "foreground" if self._waits else self.level,
            "foreground" if self._raised else "background",
        )

    @contextmanager
    def _changing(self) -> Iterator[None]:
        """Change the governor's level or a count of waits under the lock, then move the
        threads of each group whose level that changed (and forget the others that ended)."""
        with self._lock:
            before = self._levels()
            yield
            after = self._levels()
            if after == before:
                return
            for tid, thread in list(self._tids.items()):
                group = tid in self._always
                if before[group] != after[group]:
                    self._apply(tid, after[group])  # (forgets a thread that ended)
                elif not thread.is_alive():
                    self._forget(tid)

    @property
    def threads(self) -> list[int]:
        """The ids of the save's registered threads still alive (the ones :meth:`set` moves)."""
        with self._lock:
            return sorted(
                t for t, th in self._tids.items() if th.is_alive() and t not in self._always
            )

    @property
    def background_threads(self) -> list[int]:
        """The ids of the live threads registered with :meth:`register_background`."""
        with self._lock:
            return sorted(t for t in self._always if self._tids[t].is_alive())

    def describe(self) -> str:
        """The background level in words (journal and status)."""
        if not self._works:
            return "unmanaged"
        return f"SCHED_BATCH, nice {BACKGROUND_NICE}" if self.use_nice else "SCHED_BATCH"

    def _apply(self, tid: int, level: str) -> None:
        if not self._works:
            return
        thread = self._tids.get(tid)
        if thread is None or not thread.is_alive():
            self._forget(tid)
            return
        policy = BATCH if level == "background" else OTHER
        try:
            os.sched_setscheduler(tid, policy, os.sched_param(0))  # type: ignore[arg-type]
            if self.use_nice:
                nice = BACKGROUND_NICE if level == "background" else 0
                os.setpriority(os.PRIO_PROCESS, tid, nice)
        except ProcessLookupError:  # the thread ended just now
            self._forget(tid)
        except PermissionError:  # not ours to change here (a sandbox): stop trying
            self._works = False
        except OSError:
            self._forget(tid)

    def _forget(self, tid: int) -> None:
        self._tids.pop(tid, None)
        self._always.discard(tid)
