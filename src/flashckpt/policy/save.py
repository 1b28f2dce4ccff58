"""Save policies: *when* to save. Small objects, composable with ``|`` (save if any says so).

Policies are pure: no I/O, no threads, no clock. Everything they know arrives in a
:class:`RunStats` built by the Checkpointer, or through ``Auto.observe_history(journal events)``.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from flashckpt.errors import ConfigError
from flashckpt.policy.interval import (
    _check_nonneg,
    _check_pos,
    _num,
    crash_history,
    optimal_interval_s,
    primary_events,
)

log = logging.getLogger(__name__)

__all__ = [
    "AnySave",
    "Auto",
    "EverySeconds",
    "EverySteps",
    "RunStats",
    "SavePolicy",
    "as_save_policy",
]

# Auto journals a new decision when its interval moves by more than this fraction (or its reason
# changes); smaller drifts from noisy means are not worth a journal line.
REJOURNAL_REL_CHANGE = 0.10
# How many recent journal records Auto averages for its cold-start cost / step time / persist time.
HISTORY_WINDOW = 20


@dataclass(frozen=True, kw_only=True)
class RunStats:
    """What the Checkpointer measured, handed to ``SavePolicy.should_save`` once per step.

    ``step``: the step just completed. ``now_s``: current time in seconds (any clock, as long as
    ``last_save_s`` uses the same one). ``last_save_step`` / ``last_save_s``: step and time of the
    last ``save`` call in this process; after a restore and before the first save, the restored
    step (and ``None``). ``step_time_s``: mean seconds per training step. ``save_cost_s``: mean
    seconds the training loop was blocked per save. ``persist_s``: mean seconds from a save call to
    durable in the slowest tier. Measurements are ``None`` until measured.
    """

    step: int
    now_s: float
    last_save_step: int | None = None
    last_save_s: float | None = None
    step_time_s: float | None = None
    save_cost_s: float | None = None
    persist_s: float | None = None

    def __post_init__(self) -> None:
        if isinstance(self.step, bool) or not isinstance(self.step, int) or self.step < 0:
            raise ConfigError(f"RunStats.step must be an int >= 0, got {self.step!r}")
        for name in ("step_time_s", "save_cost_s", "persist_s"):
            value = getattr(self, name)
            if value is not None:
                _check_nonneg(f"RunStats.{name}", value)


@runtime_checkable
class SavePolicy(Protocol):
    """Decides at which steps the Checkpointer saves.

    The contract, in the order the Checkpointer calls it:

    1. Once per training step, ``should_save(stats)`` with fresh :class:`RunStats`; it returns
       ``True`` when the step just completed should be saved. It does no I/O and reads no clock.
    2. Right after, ``take_decision()``: a dict with the fields of an ``interval`` journal event
       (``policy, interval_s, interval_steps, cost_s, mtbf_s, restart_s, persist_s, reason``) when
       the policy's chosen interval changed since the last call, else ``None``. Each decision is
       returned once; the Checkpointer appends it to the journal.
    """

    def should_save(self, stats: RunStats) -> bool: ...

    def take_decision(self) -> dict[str, Any] | None: ...


class _SaveComposable:
    def __or__(self, other: SavePolicy) -> AnySave:
        if not isinstance(other, SavePolicy):
            raise ConfigError(f"can only combine save policies with |, got {other!r}")
        left = self.policies if isinstance(self, AnySave) else (self,)
        right = other.policies if isinstance(other, AnySave) else (other,)
        return AnySave(policies=(*left, *right))  # type: ignore[arg-type]


class _Once:
    """Holds the one decision a fixed policy announces (its configured interval)."""

    def __init__(self) -> None:
        self.made = False
        self.pending: dict[str, Any] | None = None

    def offer(self, decision: dict[str, Any]) -> None:
        self.made, self.pending = True, decision

    def take(self) -> dict[str, Any] | None:
        d, self.pending = self.pending, None
        return d


def _fixed_decision(
    policy: str, stats: RunStats, *, steps: int | None, seconds: float | None
) -> dict[str, Any]:
    dt = stats.step_time_s
    interval_s = seconds if seconds is not None else (steps * dt if steps and dt else None)
    if steps is None and seconds is not None and dt:
        steps = max(1, math.ceil(seconds / dt))
    return {
        "policy": policy,
        "interval_s": interval_s,
        "interval_steps": steps,
        "cost_s": stats.save_cost_s,
        "mtbf_s": None,
        "restart_s": None,
        "persist_s": stats.persist_s,
        "reason": "fixed interval configured",
    }


@dataclass(frozen=True)
class EverySteps(_SaveComposable):
    """Save at every step that is a positive multiple of ``n`` (aligned across restarts)."""

    n: int
    _once: _Once = field(default_factory=lambda: _Once(), init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if isinstance(self.n, bool) or not isinstance(self.n, int) or self.n < 1:
            raise ConfigError(f"EverySteps(n) needs an integer n >= 1, got {self.n!r}")

    def should_save(self, stats: RunStats) -> bool:
        # announced once the step time is measured, so the interval is known in seconds too
        if not self._once.made and stats.step_time_s is not None:
            self._once.offer(_fixed_decision("every_steps", stats, steps=self.n, seconds=None))
        return stats.step > 0 and stats.step % self.n == 0 and stats.step != stats.last_save_step

    def take_decision(self) -> dict[str, Any] | None:
        return self._once.take()


@dataclass(frozen=True)
class EverySeconds(_SaveComposable):
    """Save when ``t`` seconds passed since the last save (or, before the first save, when the
    steps done so far times the step time reach ``t``)."""

    t: float
    _once: _Once = field(default_factory=lambda: _Once(), init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        _check_pos("EverySeconds(t)", self.t)

    def should_save(self, stats: RunStats) -> bool:
        if not self._once.made:
            self._once.offer(_fixed_decision("every_seconds", stats, steps=None, seconds=self.t))
        if stats.step == stats.last_save_step:
            return False
        if stats.last_save_s is not None:
            return stats.now_s - stats.last_save_s >= self.t
        if stats.step_time_s is not None:
            done = stats.step - (stats.last_save_step or 0)
            return done * stats.step_time_s >= self.t
        return False

    def take_decision(self) -> dict[str, Any] | None:
        return self._once.take()


@dataclass(frozen=True, kw_only=True)
class AnySave(_SaveComposable):
    """Save when any of ``policies`` says so. Every policy sees every step (no short-circuit),
    and their decisions are handed out one per ``take_decision`` call, in order."""

    policies: tuple[SavePolicy, ...]
    _queue: list[dict[str, Any]] = field(default_factory=list, init=False, repr=False)

    def __post_init__(self) -> None:
        if not self.policies or not all(isinstance(p, SavePolicy) for p in self.policies):
            raise ConfigError(
                "AnySave(policies=...) needs one or more save policies "
                "(EverySteps, EverySeconds, Auto)"
            )

    def should_save(self, stats: RunStats) -> bool:
        return any([p.should_save(stats) for p in self.policies])

    def take_decision(self) -> dict[str, Any] | None:
        for p in self.policies:
            d = p.take_decision()
            if d is not None:
                self._queue.append(d)
        return self._queue.pop(0) if self._queue else None


def step_based(policy: SavePolicy) -> bool:
    """True when ``policy`` decides from the step number alone (``EverySteps``, or ``|`` of
    them): every rank of a distributed job then reaches the same decisions without talking.
    Clock- and measurement-based policies (``EverySeconds``, ``Auto``, custom ones) do not."""
    if isinstance(policy, EverySteps):
        return True
    return isinstance(policy, AnySave) and all(step_based(p) for p in policy.policies)


def _recent_mean(values: Sequence[float]) -> float | None:
    tail = list(values)[-HISTORY_WINDOW:]
    return sum(tail) / len(tail) if tail else None


def _field(events: Sequence[Mapping[str, Any]], name: str, key: str) -> list[float]:
    out = []
    for e in events:
        v = _num(e.get(key)) if e.get("event") == name else None
        if v is not None and v >= 0:
            out.append(v)
    return out


def as_save_policy(value: SavePolicy | int | None) -> SavePolicy | None:
    """``None`` -> no automatic saves, an int ``n`` -> ``EverySteps(n)``, a policy -> itself."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise ConfigError("save_policy= takes a save policy or an int, not a bool")
    if isinstance(value, int):
        return EverySteps(value)
    if isinstance(value, SavePolicy):
        return value
    raise ConfigError(
        f"save_policy={value!r} is not a save policy; use an int, flashckpt.policy.EverySteps(n), "
        "EverySeconds(t), Auto(mtbf_s=...), or combine them with |"
    )


class Auto(_SaveComposable):
    """Save at Daly's (2006) optimum interval, from measured costs and the journal's failures.

    Each step it computes ``τ = optimal_interval_s(C, M)`` (Young 1974 for small ``C/M``) where

    - ``C`` is the measured mean cost of a save to the loop (``RunStats.save_cost_s``: blocking
      plus the slowdown of the steps while it persisted, engine/runtime/meter.py);
    - ``M`` is :func:`~flashckpt.policy.interval.estimate_mtbf_s` over the journal history given
      to ``observe_history`` (the configured ``mtbf_s`` counts as ``prior_weight`` failure-free
      intervals), plus the failure-free time this process has run so far;
    - ``τ`` is never below ``persist_s`` (the slowest tier must finish persisting one checkpoint
      before the next starts) nor below ``min_interval_s``;
    - ``τ`` is converted to steps with the measured step time: save when
      ``step − last_save_step >= ceil(τ / step_time_s)``.

    Cold start: until this process measured a save, ``C`` is the mean ``cost_s`` of the
    journal's last ``interval`` decisions made on a measured cost (what an earlier process of
    the run measured, slowdown of the steps included), else the mean ``blocking_s`` of the last
    saves in the journal, else ``prior_cost_s``; likewise the step time and the persist
    time fall back to the journal's ``step_time`` and ``durable`` records. Without any step time it
    compares seconds since the last save with ``τ``; with neither, it waits.

    A new ``interval`` journal record is offered by ``take_decision`` when ``τ`` moves by more
    than 10% or the reason changes (e.g. cold start -> measured).
    """

    def __init__(
        self,
        *,
        mtbf_s: float,
        restart_s: float = 0.0,
        min_interval_s: float = 0.0,
        prior_cost_s: float = 1.0,
        prior_weight: float = 1.0,
        history: Sequence[Mapping[str, Any]] | None = None,
    ) -> None:
        self.mtbf_s = _check_pos("Auto(mtbf_s)", mtbf_s)
        self.restart_s = _check_nonneg("Auto(restart_s)", restart_s)
        self.min_interval_s = _check_nonneg("Auto(min_interval_s)", min_interval_s)
        self.prior_cost_s = _check_nonneg("Auto(prior_cost_s)", prior_cost_s)
        self.prior_weight = _check_pos("Auto(prior_weight)", prior_weight)
        self._uptime_s = 0.0
        self._failures = 0
        self._hist: dict[str, float | None] = {"cost": None, "step": None, "persist": None}
        self._first_now_s: float | None = None
        self._journaled: tuple[float, str, bool] | None = None
        self._pending: dict[str, Any] | None = None
        self.last_decision: dict[str, Any] | None = None
        if history is not None:
            self.observe_history(history)

    def __repr__(self) -> str:
        return (
            f"Auto(mtbf_s={self.mtbf_s!r}, restart_s={self.restart_s!r}, "
            f"min_interval_s={self.min_interval_s!r})"
        )

    def observe_history(self, events: Sequence[Mapping[str, Any]]) -> None:
        """Learn failures, uptime and recent save costs from journal events (replaces the last
        history given). Pass the whole journal, including this run's ``run_start``."""
        evs = primary_events(events)
        hist = crash_history(evs)
        self._uptime_s, self._failures = hist.uptime_s, hist.failures
        self._first_now_s = None
        # the cost a previous run measured (blocking + slowdown of the steps in flight, in its
        # ``interval`` decisions) beats the blocking alone that ``staged`` records hold
        measured = [
            e for e in evs if e.get("event") == "interval" and "measured" in str(e.get("reason"))
        ]
        cost = _recent_mean(_field(measured, "interval", "cost_s"))
        self._hist = {
            "cost": cost if cost is not None else _recent_mean(_field(evs, "staged", "blocking_s")),
            "step": _recent_mean(_field(evs, "step_time", "seconds")),
            "persist": _recent_mean(_field(evs, "durable", "background_s")),
        }

    def mtbf_estimate_s(self, *, live_uptime_s: float = 0.0) -> float:
        """Posterior-mean MTBF (see ``estimate_mtbf_s``) including ``live_uptime_s``."""
        w = self.prior_weight
        return (w * self.mtbf_s + self._uptime_s + live_uptime_s) / (w + self._failures)

    def decide(self, stats: RunStats) -> dict[str, Any]:
        """The interval decision for ``stats`` (fields of an ``interval`` journal event)."""
        if self._first_now_s is None:
            self._first_now_s = stats.now_s
        mtbf = self.mtbf_estimate_s(live_uptime_s=max(0.0, stats.now_s - self._first_now_s))
        cost, source = stats.save_cost_s, "measured"
        if cost is None:
            cost, source = self._hist["cost"], "journal history"
        if cost is None:
            cost, source = self.prior_cost_s, "prior (cold start)"
        persist = stats.persist_s if stats.persist_s is not None else self._hist["persist"]
        best = optimal_interval_s(cost, mtbf)
        tau, reason = best, f"daly optimum, {source} save cost"
        if persist is not None and persist > tau:
            tau, reason = persist, f"floored at slowest-tier persist time ({source} save cost)"
        if self.min_interval_s > tau:
            tau, reason = self.min_interval_s, f"floored at min_interval_s ({source} save cost)"
        step_s = stats.step_time_s if stats.step_time_s is not None else self._hist["step"]
        steps = max(1, math.ceil(tau / step_s - 1e-9)) if step_s else None
        return {
            "policy": "auto",
            "interval_s": tau,
            "interval_steps": steps,
            "cost_s": cost,
            "mtbf_s": mtbf,
            "restart_s": self.restart_s,
            "persist_s": persist,
            "reason": reason,
        }

    def should_save(self, stats: RunStats) -> bool:
        d = self.decide(stats)
        self._offer(d)
        if stats.step == stats.last_save_step:
            return False
        if d["interval_steps"] is not None:
            return bool(stats.step - (stats.last_save_step or 0) >= d["interval_steps"])
        if stats.last_save_s is not None:
            return bool(stats.now_s - stats.last_save_s >= d["interval_s"])
        return False

    def _offer(self, d: dict[str, Any]) -> None:
        self.last_decision = d
        tau, reason = float(d["interval_s"]), str(d["reason"])
        has_steps = d["interval_steps"] is not None
        if self._journaled is not None:
            old_tau, old_reason, old_has_steps = self._journaled
            moved = abs(tau - old_tau) > REJOURNAL_REL_CHANGE * max(old_tau, 1e-9)
            if not moved and (reason, has_steps) == (old_reason, old_has_steps):
                return
        self._journaled = (tau, reason, has_steps)
        self._pending = d
        log.info("checkpoint interval %.1fs (%s steps): %s", tau, d["interval_steps"], reason)

    def take_decision(self) -> dict[str, Any] | None:
        d, self._pending = self._pending, None
        return d
