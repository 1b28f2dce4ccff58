"""Run measurements feeding the save policy: step time, blocking cost, time to durable."""

from __future__ import annotations

from collections import deque
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

    def tick(self, step: int, now_s: float) -> float | None:
        """Record that ``step`` completed at ``now_s``; returns the mean step time."""
        if self._prev is not None and step > self._prev[0]:
            self._step_times.append((now_s - self._prev[1]) / (step - self._prev[0]))
        self._prev = (step, now_s)
        self._since_journal += 1
        return _mean(self._step_times)

    def journal_due(self, every: int = 50) -> bool:
        if self._since_journal >= every and self._step_times:
            self._since_journal = 0
            return True
        return False

    def saved(self, step: int, now_s: float) -> None:
        self.last_save_step, self.last_save_s = step, now_s

    def durable(self, *, blocking_s: float, background_s: float) -> None:
        self._costs.append(blocking_s)
        self._persist.append(background_s)

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
