"""Run measurements feeding the save policy: step time, the cost of a save, time to durable.

The cost of a save to training is what it adds to the steps, not only the seconds ``save()``
blocked: while a save persists in the background its copies, hashing and writes compete with
training for the cores and the memory bus (on a CPU-bound loop, most of the cost). So the
meter keeps the median of *clean* step intervals (no save in flight) and charges each save the
excess of every interval it was in flight over that median, its blocking included (the
interval holding ``save()``); the figure is final at the first tick after it is durable and its
promotion to the slower tiers ended (copying the step to disk, read back and verified, costs
training about as much as the save itself; a cost that left it out made ``Auto`` save too
often). A save that a next one overtakes costs what it added up to then. With no clean
interval measured yet, or no tick during the save, a save costs its blocking time.
"""

from __future__ import annotations

import statistics
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from flashckpt.policy.save import RunStats

_WINDOW = 20


def _mean(values: deque[float]) -> float | None:
    return sum(values) / len(values) if values else None


@dataclass(kw_only=True)
class RunMeter:
    last_save_step: int | None = None
    last_save_s: float | None = None
    _prev: tuple[int, float] | None = None
    _step_times: deque[float] = field(default_factory=lambda: deque(maxlen=_WINDOW))
    _costs: deque[float] = field(default_factory=lambda: deque(maxlen=_WINDOW))
    _persist: deque[float] = field(default_factory=lambda: deque(maxlen=_WINDOW))
    _since_journal: int = 0
    _clean: deque[float] = field(default_factory=lambda: deque(maxlen=_WINDOW))
    _flight: list[float] | None = None  # [excess so far, blocking] of the save in flight
    _durable_seen: bool = False  # the save in flight is durable (set by the durable callback)
    _until: threading.Event | None = None  # ... and its promotion ends when this is set
    on_cost: Callable[[float], None] | None = None  # told each save's final cost (the governor)

    def tick(self, step: int, now_s: float) -> float | None:
        """Record that ``step`` completed at ``now_s``; returns the mean step time."""
        if self._prev is not None and step > self._prev[0]:
            interval = (now_s - self._prev[1]) / (step - self._prev[0])
            self._step_times.append(interval)
            self._charge(interval * (step - self._prev[0]), step - self._prev[0])
        self._prev = (step, now_s)
        self._since_journal += 1
        return _mean(self._step_times)

    def _charge(self, seconds: float, steps: int) -> None:
        flight = self._flight
        if flight is None:
            self._clean.append(seconds / steps)
            return
        if self._clean:
            flight[0] += max(0.0, seconds - steps * statistics.median(self._clean))
        until = self._until
        if self._durable_seen and (until is None or until.is_set()):  # it ended: cost final
            self._settle()

    def journal_due(self, every: int = 50) -> bool:
        if self._since_journal >= every and self._step_times:
            self._since_journal = 0
            return True
        return False

    def saved(self, step: int, now_s: float, *, started: bool = True) -> None:
        """A save of ``step`` started at ``now_s`` (``started=False``: ``step`` was restored)."""
        self.last_save_step, self.last_save_s = step, now_s
        if started:
            self._settle()  # an earlier save that no tick saw end costs its blocking time
            self._flight, self._durable_seen = [0.0, 0.0], False

    def durable(
        self, *, blocking_s: float, background_s: float, until: threading.Event | None = None
    ) -> None:
        """The save in flight is durable; ``until``: the event its promotion sets at its end."""
        self._persist.append(background_s)
        if self._flight is None:
            self._cost(blocking_s)
            return
        self._flight[1] = blocking_s
        self._until = until
        self._durable_seen = True

    def _settle(self) -> None:
        """Charge the save in flight what it added so far, if it is durable (its promotion
        may still run: a next save overtook it), and end it."""
        flight = self._flight
        if flight is not None and self._durable_seen:
            self._cost(max(flight[0], flight[1]) if self._clean else flight[1])
        self._flight, self._durable_seen, self._until = None, False, None

    def _cost(self, seconds: float) -> None:
        self._costs.append(seconds)
        if self.on_cost is not None:
            self.on_cost(seconds)

    def stats(self, step: int, now_s: float) -> RunStats:
        return RunStats(
            step=step,
            now_s=now_s,
            last_save_step=self.last_save_step,
            last_save_s=self.last_save_s,
            step_time_s=_mean(self._step_times),
            save_cost_s=_mean(self._costs),
            persist_s=_mean(self._persist),
        )
