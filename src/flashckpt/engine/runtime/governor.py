"""The governor: a save's background work never costs the loop more than doing it in the
foreground.

An asynchronous save overlaps training, but its copies, hashing and writes take cores, cache
and memory bandwidth from the steps, and on a host that other work already saturates (data
loader workers, another job, torch's thread team on every core) that can cost the loop more
than stopping it for a synchronous save would. So the governor measures what each save really
cost the loop and runs the next one the cheaper way:

* **Measured, not assumed.** The optimizer pre-step hook that async saves already install ticks
  a step clock (:class:`~flashckpt.engine.runtime.meter.RunMeter`): a save's cost is the excess of
  every step interval it was in flight over the median clean interval, its blocking included,
  final once it is durable and its promotion ended. Loops that call ``should_save`` or
  ``step`` every step are measured by that meter too; this one needs nothing from the loop.
* **Two ways to run a save.** ``background``: ``save()`` returns once the state is staged (with
  ``overlap=True``, at once) and the rest overlaps training. ``foreground``: ``save()`` returns
  once the save is durable, the loop stopped meanwhile: the cost of a synchronous save, through
  the same single-pass path.
* **The cheaper one wins.** The budget of a save is ``budget_s`` when given, else the measured
  cost of a foreground save of the same state (what a synchronous save costs here and now).
  The second save of a run is a foreground probe, unless an earlier run on the same root
  journaled that cost (:meth:`Governor.observe_history`): a restarted process then starts from
  it instead of paying a synchronous save, its cold one, after every restart. A probe waits for
  the regular schedule (``probe_every`` saves) while the background costs the loop at most half
  its own time to durable: a foreground save, which costs the loop its time to durable, is
  then cheaper only if stopping the loop makes the save more than twice as fast, and the
  regular probe checks that. A short run whose saves clearly overlap pays no synchronous save.
  From then on each save runs in the mode whose recent saves cost less, background while it
  stays within the budget, and every ``probe_every`` saves the other mode is measured again,
  because what the background costs changes with what else runs on the host.
* **Probes grow rarer while the answer is clear.** A foreground probe is a synchronous save: on
  the 2-core VM's dispatch loop, 0.15 s against 0.04 s for a background save of the same 256
  MiB, so one probe every 8 saves added a third to the steady cost of a save. Each foreground
  probe that finds the background at most half its cost doubles the saves until the next one,
  up to ``probe_max``; a closer or reversed answer, or a background that goes over the
  budget, brings it back to ``probe_every``.

Work that no save needs (the idle scrub) asks :meth:`Governor.idle_work_waits` before each
step: it waits while the saves' background work is measured costlier than its budget, and
while the host has no idle core to give it (:mod:`~flashckpt.engine.runtime.hostcpu`).

Every decision is journaled (``governor``: the mode chosen, why, the costs of both modes and
the budget); ``flashckpt status`` and the report show the latest.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from flashckpt.engine.runtime.hostcpu import IdleCpu
from flashckpt.engine.runtime.meter import RunMeter
from flashckpt.journal import Journal

BACKGROUND, FOREGROUND = "background", "foreground"
_KEEP = 4  # costs remembered per mode
CLEAR = 0.5  # a background at most this share of the foreground's cost: probe less often


def _mean(values: deque[float]) -> float | None:
    return sum(values) / len(values) if values else None


@dataclass(kw_only=True)
class Governor:
    journal: Journal | None = None
    budget_s: float | None = None  # a save may cost the loop at most this (None: foreground's)
    probe_every: int = 8
    probe_max: int = 64  # the longest wait between probes while background clearly wins
    enabled: bool = True
    mode: str = BACKGROUND  # how the next save runs
    meter: RunMeter = field(default_factory=RunMeter)
    costs: dict[str, deque[float]] = field(
        default_factory=lambda: {BACKGROUND: deque(maxlen=_KEEP), FOREGROUND: deque(maxlen=_KEEP)}
    )
    saves: int = 0
    _ticks: int = 0
    _since_probe: int = 0
    _interval: int = 0  # saves until the next probe (probe_every, doubled while clear)
    # (step, mode, whether any step was ticked before it) of the save being measured
    _flight: tuple[int, str, bool] | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)
    last: dict[str, object] = field(default_factory=dict)  # the latest decision (status)
    priority: str = "unmanaged"  # the background threads' CPU level (engine/runtime/priority.py)
    saturated: bool = False  # background work measured costlier than its budget: idle work waits
    host: IdleCpu = field(default_factory=IdleCpu)  # whether the host has a core to spare
    inherited_s: float | None = None  # the foreground cost taken from an earlier run's journal
    # time to durable of the recent background saves (the first probe waits while it is clear)
    durations: deque[float] = field(default_factory=lambda: deque(maxlen=_KEEP))
    _durable_s: float | None = None  # the save in flight's, once durable

    def __post_init__(self) -> None:
        self.meter.on_cost = self._settled
        self._interval = self.probe_every

    # -- what the save path calls -----------------------------------------------------------
    def tick(self) -> None:
        """One optimizer step began (the async saves' pre-step hook)."""
        with self._lock:
            self._ticks += 1
            self.meter.tick(self._ticks, time.perf_counter())

    def started(self, step: int) -> str:
        """A save of ``step`` starts; returns how it runs (``background`` or ``foreground``)."""
        with self._lock:
            mode = self.mode if self.enabled else BACKGROUND
            self.meter.saved(self._ticks, time.perf_counter())
            self._flight = (step, mode, self._ticks > 0)
            self.saves += 1
            return mode

    def durable(self, *, blocking_s: float, background_s: float, until: threading.Event | None):
        """The save being measured is durable (``until``: set when its promotion ended)."""
        with self._lock:
            self._durable_s = background_s
            self.meter.durable(blocking_s=blocking_s, background_s=background_s, until=until)

    def observe_history(self, events: Sequence[Mapping[str, Any]]) -> None:
        """Start from the newest foreground cost a run of this rank journaled (``governor``
        events), so a restarted process skips the foreground probe."""
        rank = self.journal.rank if self.journal is not None else None
        for e in reversed(events):
            if e.get("event") != "governor" or e.get("rank") != rank:
                continue
            fg = e.get("foreground_cost_s")
            if type(fg) in (int, float) and 0 <= fg < 1e6:  # the newest measured one
                with self._lock:
                    self.costs[FOREGROUND].append(float(fg))
                    self.inherited_s = float(fg)
                return

    def idle_work_waits(self) -> bool:
        """Whether work that no save needs must wait now (see the module)."""
        return (self.enabled and self.saturated) or self.host.busy()

    # -- deciding ---------------------------------------------------------------------------
    def _settled(self, cost_s: float) -> None:
        """The meter's final cost of the save in flight (called under ``_lock``)."""
        if self._flight is None:
            return
        step, mode, ticked = self._flight
        self._flight = None
        if not ticked:
            # the pre-step hook that ticks this meter is installed by the first async save, so
            # no step interval came before it and its "cost" is its blocking alone (0.005 s
            # where saves cost the loop 0.25 s in the chaos run). Not a measurement: the next
            # save runs the same way and is measured.
            self.last = {"step": step, "ran": mode, "next": self.mode, "why": "not measured: "
                         "no step was timed before this save"}  # fmt: skip
            return
        self.costs[mode].append(cost_s)
        if mode == BACKGROUND and self._durable_s is not None:
            self.durations.append(self._durable_s)
        self._durable_s = None
        self.mode, why = self._next(mode)
        bg, fg = _mean(self.costs[BACKGROUND]), _mean(self.costs[FOREGROUND])
        budget = self.budget_s if self.budget_s is not None else fg
        self.last = {
            "step": step,
            "ran": mode,
            "cost_s": round(cost_s, 6),
            "next": self.mode,
            "why": why,
            "background_cost_s": None if bg is None else round(bg, 6),
            "foreground_cost_s": None if fg is None else round(fg, 6),
            "budget_s": None if budget is None else round(budget, 6),
            "priority": self.priority,
        }
        if self.journal is not None and self.enabled:
            self.journal.append("governor", **self.last)

    def _next(self, ran: str) -> tuple[str, str]:
        bg, fg = _mean(self.costs[BACKGROUND]), _mean(self.costs[FOREGROUND])
        budget = self.budget_s if self.budget_s is not None else fg
        self._since_probe += 1
        if fg is None and self.budget_s is None:
            took = _mean(self.durations)
            clear = bg is not None and took is not None and bg <= CLEAR * took
            if clear and self._since_probe < self._interval:
                return BACKGROUND, (
                    f"background cost {bg:.3f}s <= half its time to durable {took:.3f}s: the "
                    f"foreground is measured after {self._interval} saves"
                )
            return FOREGROUND, "measure what a foreground save costs (the budget)"
        if bg is None:
            return BACKGROUND, "measure what a background save costs"
        if self._since_probe >= self._interval:  # the host changes: measure the other again
            self._since_probe = 0
            other = FOREGROUND if ran == BACKGROUND else BACKGROUND
            if other == BACKGROUND or self.budget_s is None:
                return other, f"probe: {other} measured again after {self._interval} saves"
        self.saturated = budget is not None and bg > budget
        if self.saturated:
            self._interval = self.probe_every
            return FOREGROUND, f"background cost {bg:.3f}s > budget {budget:.3f}s"
        if ran == FOREGROUND and fg is not None and self.budget_s is None:  # a probe ended
            clear = bg <= CLEAR * fg
            self._interval = min(self.probe_max, 2 * self._interval) if clear else self.probe_every
        return BACKGROUND, f"background cost {bg:.3f}s <= budget " + (
            "(none measured yet)" if budget is None else f"{budget:.3f}s"
        )
