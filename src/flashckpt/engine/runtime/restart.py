"""Restart time: from the kill of the previous run to the first step this run completes.

A run that finds the previous run's marker (it died without ``close()``) starts a
:class:`RestartClock`; the run marker feeds it (``restoring``/``restored`` around the
restore call, ``tick`` on every step), and at the first step reported after the restore it
journals one ``restart`` event (primary writer only, so an N-rank job counts a restart once)::

    restart_seconds = down_s + start_s + restore_s + first_step_s
    down_s        kill -> this process started (/proc/self/stat; off Linux: when flashckpt
                  was imported, so the interpreter start moves into down_s)
    start_s       process start -> the restore call (interpreter, imports, building the model
                  and optimizer, opening the Checkpointer)
    restore_s     the restore call (None when no checkpoint was loaded; its time is then in
                  first_step_s)
    first_step_s  restore end -> the first step reported (should_save / step / save): the
                  first resumed training step

The kill instant is the previous run's last sign of life: the mtime of its run marker
(rewritten on every tick) or of the journal, whichever is later (read before this run writes
either). It is at or before the real kill, so ``restart_seconds`` errs long by at most one
step (or one save, or one restore) of the killed run. When the previous run died after this
process started (a supervisor restarting training in-process), ``down_s`` is 0. A restarted
process killed before it opened its Checkpointer leaves no trace, so the next restart's figure
spans both failures (from the last run that did).

``imported_s`` and ``ready_s`` are milestones inside ``start_s``: seconds from the process
start until flashckpt was imported and until the Checkpointer was ready.

A warm standby that takes over (engine/runtime/takeover.py) was started before the kill, so
for it ``down_s`` is the *wait*: kill -> the standby woke (the launcher saw the death and the
kernel released the writer lock), and ``start_s`` is opening the Checkpointer; the event then
also has ``takeover: true``, ``wait_s`` (= ``down_s``) and ``open_s`` (= ``start_s``).

A clean previous run (``close()`` removed its marker) journals no restart: nothing says when
it stopped being useful.
"""

from __future__ import annotations

import os
import time

from flashckpt.journal import Journal
from flashckpt.version import IMPORTED_T  # when flashckpt was imported


def process_start_time() -> tuple[float, str]:
    """Wall-clock time this process started and its source: ``"proc"`` (Linux, 10 ms
    resolution) or ``"import"`` (elsewhere: when flashckpt was imported)."""
    try:
        with open("/proc/self/stat", "rb") as f:
            stat = f.read()
        ticks = int(stat.rsplit(b")", 1)[1].split()[19])  # field 22: starttime, since boot
        since_boot = time.clock_gettime(time.CLOCK_BOOTTIME)
        start = time.time() - (since_boot - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError, AttributeError):
        return IMPORTED_T, "import"
    return min(start, IMPORTED_T), "proc"


def last_sign_of_life(mtimes: list[float | None]) -> float | None:
    """The latest of ``mtimes`` (None: nothing known)."""
    known = [t for t in mtimes if t is not None]
    return max(known) if known else None


class RestartClock:
    """Times one restart; journals it at the first step after the restore (see the module)."""

    def __init__(self, journal: Journal, *, signs_of_life: list[float | None]) -> None:
        """``signs_of_life``: mtimes of what the previous run last wrote (marker, journal)."""
        self.journal = journal
        self.process_t, self.source = process_start_time()
        self.killed_t = last_sign_of_life(signs_of_life)
        self.ready_t = time.time()  # the Checkpointer is open
        self._restore_t0: float | None = None
        self._restore_t1: float | None = None
        self._restored_step: int | None = None
        self.woke_t: float | None = None  # a standby's takeover: when it woke
        self.done = self.killed_t is None

    def takeover(self, woke_t: float) -> None:
        """This process is a standby that took over at ``woke_t`` (see the module)."""
        self.woke_t = woke_t

    def restoring(self) -> None:
        if not self.done and self._restore_t0 is None:
            self._restore_t0 = time.time()

    def restored(self, step: int) -> None:
        if not self.done:
            self._restore_t1, self._restored_step = time.time(), step

    def tick(self, step: int | None) -> dict[str, object] | None:
        """The first step reported after the restore journals the restart (once)."""
        if self.done or step is None or self.killed_t is None:
            return None
        self.done = True
        return self.journal.append("restart", step=step, **self.parts(self.killed_t, time.time()))

    def parts(self, killed_t: float, now: float) -> dict[str, object]:
        """The restart's fields when the first step is at ``now``; the parts sum to the total."""
        a = killed_t
        b = max(self.process_t if self.woke_t is None else self.woke_t, a)
        loaded = self._restore_t0 is not None and self._restore_t1 is not None
        c = max(self._restore_t0 if self._restore_t0 is not None else self.ready_t, b)
        d = max(self._restore_t1, c) if loaded and self._restore_t1 is not None else c
        e = max(now, d)
        r = lambda v: round(v, 6)  # noqa: E731
        extra: dict[str, object] = {}
        if self.woke_t is not None:
            extra = {"takeover": True, "wait_s": r(b - a), "open_s": r(c - b)}
        return {
            **extra,
            "restart_seconds": r(e - a),
            "down_s": r(b - a),
            "start_s": r(c - b),
            "restore_s": r(d - c) if loaded else None,
            "first_step_s": r(e - d),
            "restored_step": self._restored_step,
            "killed_t": a,
            "process_t": self.process_t,
            "start_source": self.source,
            "imported_s": r(max(0.0, IMPORTED_T - b)),
            "ready_s": r(max(0.0, self.ready_t - b)),
        }
