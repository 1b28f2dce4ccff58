"""Checkpoint-interval formulas and MTBF estimation from the run journal (pure functions).

Notation (Daly 2006): ``C`` (``cost_s``) is the time the training loop is blocked by one save,
``M`` (``mtbf_s``) the mean time between failures, ``R`` (``restart_s``) the time from a failure
until training runs again (reschedule, restart, restore), and ``τ`` (``interval_s``) the compute
time between two saves. Failures are assumed to arrive as a Poisson process (exponential gaps).

- Young 1974, "A first order approximation to the optimum checkpoint interval", CACM 17(9):
  ``τ ≈ sqrt(2·C·M)``.
- Daly 2006, "A higher order estimate of the optimum checkpoint interval for restart dumps",
  FGCS 22(3): ``τ = sqrt(2·C·M)·[1 + ⅓·sqrt(C/2M) + ⅑·(C/2M)] − C`` for ``C < 2M``, else ``τ = M``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from flashckpt.errors import ConfigError
from flashckpt.units import finite_number

__all__ = [
    "CrashHistory",
    "RunSplitter",
    "crash_history",
    "estimate_mtbf_s",
    "expected_waste_fraction",
    "optimal_interval_s",
    "young_interval_s",
]


def _check_nonneg(name: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        raise ConfigError(f"{name} must be a finite number >= 0 (seconds), got {value!r}")
    if math.isinf(value):
        raise ConfigError(f"{name} must be finite, got {value!r}")
    return float(value)


def _check_pos(name: str, value: float) -> float:
    v = _check_nonneg(name, value)
    if v <= 0:
        raise ConfigError(f"{name} must be > 0 (seconds), got {value!r}")
    return v


def young_interval_s(cost_s: float, mtbf_s: float) -> float:
    """Young's (1974) first-order optimum ``sqrt(2·C·M)``."""
    c, m = _check_nonneg("cost_s", cost_s), _check_pos("mtbf_s", mtbf_s)
    return math.sqrt(2.0 * c * m)


def optimal_interval_s(cost_s: float, mtbf_s: float) -> float:
    """Daly's (2006) higher-order optimum compute time between saves.

    ``sqrt(2CM)·[1 + ⅓·sqrt(C/2M) + ⅑·(C/2M)] − C`` when ``C < 2M``, else ``M``. For small
    ``C/M`` this is Young's (1974) ``sqrt(2CM)`` (the correction terms vanish relative to it).
    ``cost_s == 0`` gives 0: saving is free, so save as often as allowed (callers floor it).
    """
    c, m = _check_nonneg("cost_s", cost_s), _check_pos("mtbf_s", mtbf_s)
    if c >= 2.0 * m:
        return m
    x = c / (2.0 * m)
    return math.sqrt(2.0 * c * m) * (1.0 + math.sqrt(x) / 3.0 + x / 9.0) - c


def expected_waste_fraction(
    interval_s: float,
    *,
    cost_s: float,
    mtbf_s: float,
    restart_s: float = 0.0,
    model: Literal["daly", "first_order"] = "daly",
) -> float:
    """Expected fraction of wall time not spent on useful training, in ``[0, 1]``.

    ``model="daly"`` (default) is Daly's (2006) exact expression for exponential failures that
    can also strike during saves and restarts: wall time per unit of work is
    ``M·e^(R/M)·(e^((τ+C)/M) − 1)/τ``, so waste ``= 1 − τ / (M·e^(R/M)·(e^((τ+C)/M) − 1))``.
    ``model="first_order"`` is Young's (1974) approximation ``C/τ + τ/(2M) + R/M`` (capped at 1),
    accurate when ``C``, ``τ`` and ``R`` are all small against ``M``.
    """
    tau = _check_pos("interval_s", interval_s)
    c, m = _check_nonneg("cost_s", cost_s), _check_pos("mtbf_s", mtbf_s)
    r = _check_nonneg("restart_s", restart_s)
    if model == "first_order":
        return min(1.0, c / tau + tau / (2.0 * m) + r / m)
    if model != "daly":
        raise ConfigError(f"model must be 'daly' or 'first_order', got {model!r}")
    try:
        per_work = m * math.exp(r / m) * math.expm1((tau + c) / m) / tau
    except OverflowError:
        return 1.0
    return min(1.0, max(0.0, 1.0 - 1.0 / per_work))


@dataclass(frozen=True, kw_only=True)
class CrashHistory:
    """What a journal says about failures.

    ``uptime_s``: sum over runs of (last event − ``run_start``); ``failures``: number of
    ``crash_detected`` events; ``runs``: number of runs; ``gaps_s``: for every run that did not end
    cleanly, the downtime until the next ``run_start`` (crash detection, rescheduling, restart).
    """

    uptime_s: float
    failures: int
    runs: int
    gaps_s: tuple[float, ...]


def primary_events(events: Iterable[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """Events from rank 0 (or without a rank), sorted by time; other ranks repeat them."""
    out = [e for e in events if e.get("rank") in (None, 0) and _num(e.get("t")) is not None]
    return sorted(out, key=lambda e: float(e["t"]))


def _num(value: Any) -> float | None:
    return finite_number(value)


class RunSplitter:
    """:func:`crash_history` one event at a time: :meth:`add` the primary events in time order
    (``add`` returns False, changing nothing, for one older than the last: the caller starts
    over with the events sorted), :meth:`history` at any point. A reader that polls a growing
    journal (the Prometheus exporter) pays for what was appended, not for the whole journal."""

    def __init__(self) -> None:
        self.runs: list[list[float]] = []  # [start, last]
        self.clean: list[bool] = []
        self.failures = 0
        self.opener: Any = None  # pid of the process that opened the newest run, while fresh
        self.last_t = -math.inf

    def _opens_run(self, e: Mapping[str, Any]) -> bool:
        """A run_start/crash_detected opens a run unless it follows the other one of the pair
        from the same process (nothing else journaled in between)."""
        return not self.runs or self.opener is None or self.opener != e.get("pid", self.opener)

    def add(self, e: Mapping[str, Any]) -> bool:
        t, name = float(e["t"]), e.get("event")
        if t < self.last_t:
            return False
        self.last_t = t
        runs, clean = self.runs, self.clean
        if name in ("crash_detected", "run_start"):
            if self._opens_run(e):
                if name == "run_start" and runs and e.get("clean_previous") is True:
                    clean[-1] = True
                runs.append([t, t])
                clean.append(False)
                self.opener = e.get("pid", "?")
            if name == "crash_detected":
                self.failures += 1
                since = e.get("since_t")
                if len(runs) > 1 and isinstance(since, (int, float)):
                    crashed = runs[-2]
                    if crashed[0] <= since <= runs[-1][0]:
                        crashed[1] = max(crashed[1], float(since))
        else:
            if not runs:
                runs.append([t, t])
                clean.append(False)
            self.opener = None
            if name == "run_end":
                clean[-1] = True
        runs[-1][1] = max(runs[-1][1], t)
        return True

    def history(self) -> CrashHistory:
        runs, clean = self.runs, self.clean
        gaps = tuple(
            max(0.0, runs[i + 1][0] - runs[i][1]) for i in range(len(runs) - 1) if not clean[i]
        )
        uptime = sum(last - start for start, last in runs)
        return CrashHistory(uptime_s=uptime, failures=self.failures, runs=len(runs), gaps_s=gaps)


def crash_history(events: Iterable[Mapping[str, Any]]) -> CrashHistory:
    """Split the journal into runs and total their uptime, failures and restart gaps.

    A run starts at ``run_start`` and ends at its last event; a run is clean when it logged
    ``run_end`` (or the next run says ``clean_previous``). A restarted process journals
    ``crash_detected`` (with ``since_t``, the crashed run's last sign of life: its run marker's
    last step) right before its ``run_start``; both open the new run, and the crashed run ends
    at ``since_t`` when that is later than its last event, so the gap is the downtime alone
    (the steps it trained after its last checkpoint are counted as lost work, not as downtime).
    Without any ``run_start`` the whole journal counts as one run.
    """
    split = RunSplitter()
    for e in primary_events(events):
        split.add(e)
    return split.history()


def estimate_mtbf_s(
    events: Sequence[Mapping[str, Any]], *, prior_s: float, prior_weight: float = 1.0
) -> float:
    """Posterior-mean MTBF: ``(w·prior_s + uptime_s) / (w + failures)``.

    This is the conjugate (gamma prior, exponential failures) estimate in which the configured
    prior counts as ``w = prior_weight`` observed failure-free intervals of length ``prior_s``.
    With no history it returns ``prior_s``; as uptime and failures accumulate it converges to
    ``uptime / failures``. A long run without failures raises the estimate.
    """
    prior = _check_pos("prior_s", prior_s)
    w = _check_pos("prior_weight", prior_weight)
    hist = crash_history(events)
    return (w * prior + hist.uptime_s) / (w + hist.failures)
