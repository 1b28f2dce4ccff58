"""EverySteps, EverySeconds, Auto and their composition, driven by hand-made RunStats."""

from __future__ import annotations

import math

import pytest

from flashckpt.errors import ConfigError
from flashckpt.policy import (
    AnyOf,
    AnySave,
    Auto,
    EverySeconds,
    EverySteps,
    KeepLast,
    RunStats,
    SavePolicy,
    as_save_policy,
    optimal_interval_s,
)


def stats(step: int, **kw: float | int | None) -> RunStats:
    return RunStats(step=step, now_s=float(kw.pop("now_s", step)), **kw)  # type: ignore[arg-type]


def test_every_steps_saves_on_positive_multiples_once() -> None:
    p = EverySteps(5)
    assert not p.should_save(stats(1))
    assert p.take_decision() is None  # announced only once the step time is measured
    saved = [s for s in range(0, 21) if p.should_save(stats(s, step_time_s=0.5))]
    assert saved == [5, 10, 15, 20]
    assert not p.should_save(stats(10, last_save_step=10))
    d = p.take_decision()
    assert d is not None and (d["policy"], d["interval_steps"]) == ("every_steps", 5)
    assert d["interval_s"] == 2.5
    assert p.take_decision() is None


def test_every_seconds_uses_time_since_last_save() -> None:
    p = EverySeconds(30.0)
    assert not p.should_save(stats(3))  # no step time, no previous save: wait
    assert p.should_save(stats(3, step_time_s=10.0))
    assert not p.should_save(stats(9, now_s=129.0, last_save_step=5, last_save_s=100.0))
    assert p.should_save(stats(9, now_s=130.0, last_save_step=5, last_save_s=100.0))
    d = p.take_decision()
    assert d is not None and d["interval_s"] == 30.0 and d["policy"] == "every_seconds"


def test_any_save_is_any_of_and_sees_every_policy() -> None:
    a, b = EverySteps(4), EverySteps(6)
    combo = a | b | EverySeconds(1e9)
    assert isinstance(combo, AnySave) and len(combo.policies) == 3
    saved = [s for s in range(1, 13) if combo.should_save(stats(s, step_time_s=1.0))]
    assert saved == [4, 6, 8, 12]
    got = [combo.take_decision() for _ in range(4)]
    assert [d["policy"] for d in got[:3]] == ["every_steps", "every_steps", "every_seconds"]  # type: ignore[index]
    assert got[3] is None
    assert isinstance(combo, SavePolicy)


def test_retention_composite_is_untouched() -> None:
    assert isinstance(KeepLast(1) | KeepLast(2), AnyOf)


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: EverySteps(0), "EverySteps"),
        (lambda: EverySteps(True), "EverySteps"),
        (lambda: EverySeconds(-1), "EverySeconds"),
        (lambda: Auto(mtbf_s=0), "mtbf_s"),
        (lambda: Auto(mtbf_s=10, restart_s=-1), "restart_s"),
        (lambda: AnySave(policies=()), "AnySave"),
        (lambda: EverySteps(2) | 3, "combine"),
        (lambda: RunStats(step=-1, now_s=0), "step"),
        (lambda: RunStats(step=1, now_s=0, save_cost_s=-2), "save_cost_s"),
        (lambda: as_save_policy("often"), "save_policy"),
        (lambda: as_save_policy(True), "bool"),
    ],
)
def test_bad_configuration_raises_config_error(make, match: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ConfigError, match=match):
        make()


def test_as_save_policy() -> None:
    assert as_save_policy(None) is None
    assert as_save_policy(7) == EverySteps(7)
    auto = Auto(mtbf_s=10.0)
    assert as_save_policy(auto) is auto


def test_auto_cold_start_uses_prior_cost_then_measured() -> None:
    auto = Auto(mtbf_s=3600.0, prior_cost_s=2.0)
    cold = optimal_interval_s(2.0, 3600.0)  # ≈ 118.7 s (Young: 120 s)
    assert not auto.should_save(stats(0))  # nothing measured: waits
    first = auto.take_decision()
    assert first is not None and first["interval_steps"] is None
    assert first["reason"] == "daly optimum, prior (cold start) save cost"
    assert first["interval_s"] == pytest.approx(cold)
    steps = [s for s in range(1, 200) if auto.should_save(stats(s, now_s=0.0, step_time_s=1.0))]
    assert steps[0] == 119 == math.ceil(cold)  # ceil(118.7 s / 1 s)
    second = auto.take_decision()
    assert second is not None and second["interval_steps"] == 119
    # a measured cost changes the reason and the interval; it is journaled once
    auto.should_save(stats(130, now_s=0.0, step_time_s=1.0, save_cost_s=8.0, last_save_step=119))
    third = auto.take_decision()
    assert third is not None and third["reason"] == "daly optimum, measured save cost"
    assert third["interval_s"] == pytest.approx(optimal_interval_s(8.0, 3600.0))
    auto.should_save(stats(131, now_s=0.0, step_time_s=1.0, save_cost_s=8.1, last_save_step=119))
    assert auto.take_decision() is None  # a 1% drift is not journaled


def test_auto_never_saves_faster_than_the_slowest_tier_persists() -> None:
    auto = Auto(mtbf_s=3600.0)
    run = {"step_time_s": 1.0, "save_cost_s": 0.01, "persist_s": 300.0}
    saves: list[int] = []
    for s in range(1, 1000):
        if auto.should_save(stats(s, last_save_step=saves[-1] if saves else None, **run)):
            saves.append(s)
    assert saves == [300, 600, 900]
    d = auto.take_decision()
    assert d is not None and d["interval_s"] == 300.0 and d["persist_s"] == 300.0
    assert d["reason"].startswith("floored at slowest-tier persist time")
    assert optimal_interval_s(0.01, 3600.0) < 10  # the floor, not the optimum, decided


def test_auto_min_interval_floor_and_time_fallback() -> None:
    auto = Auto(mtbf_s=3600.0, min_interval_s=500.0)
    assert not auto.should_save(stats(5, now_s=1400.0, last_save_step=1, last_save_s=1000.0))
    assert auto.should_save(stats(6, now_s=1500.0, last_save_step=1, last_save_s=1000.0))
    d = auto.take_decision()
    assert d is not None and d["reason"].startswith("floored at min_interval_s")


def test_auto_learns_from_history_and_live_uptime() -> None:
    history = [
        {"t": 0.0, "event": "run_start"},
        {"t": 50.0, "event": "staged", "step": 5, "blocking_s": 4.0},
        {"t": 60.0, "event": "durable", "step": 5, "tier": "local", "background_s": 30.0},
        {"t": 70.0, "event": "step_time", "step": 7, "seconds": 2.0},
        {"t": 100.0, "event": "run_start", "clean_previous": False},
        {"t": 100.0, "event": "crash_detected", "since_t": 0.0},
    ]
    auto = Auto(mtbf_s=1000.0, history=history)
    assert auto.mtbf_estimate_s() == pytest.approx((1000 + 70) / 2)
    auto.should_save(stats(1, now_s=5000.0))
    d = auto.take_decision()
    assert d is not None
    assert d["reason"] == "daly optimum, journal history save cost" and d["cost_s"] == 4.0
    assert d["interval_steps"] == pytest.approx(d["interval_s"] / 2.0, abs=1)
    auto.should_save(stats(2, now_s=5000.0 + 10_000.0))  # 10000 s up without failure
    assert auto.last_decision is not None
    assert auto.last_decision["mtbf_s"] == pytest.approx((1000 + 70 + 10_000) / 2)


def test_auto_cold_start_takes_the_cost_a_previous_process_measured() -> None:
    """Regression (chaos run): after each restart Auto's cold start took C from the journal's
    ``staged`` blocking (0.02 s) although the killed process had measured ~1 s per save with
    the slowdown of the steps, so it saved every 2 steps until it re-measured. Now the cost
    of the last ``interval`` decisions made on a measured cost wins."""
    measured, prior = (
        "daly optimum, measured save cost",
        "daly optimum, prior (cold start) save cost",
    )
    floored = "floored at slowest-tier persist time (measured save cost)"
    history = [
        {"t": 0.0, "event": "run_start"},
        {"t": 50.0, "event": "staged", "step": 5, "blocking_s": 0.02},
        {"t": 60.0, "event": "interval", "cost_s": 0.01, "reason": prior},
        {"t": 70.0, "event": "interval", "cost_s": 1.2, "reason": measured},
        {"t": 80.0, "event": "interval", "cost_s": 0.8, "reason": floored},
    ]
    auto = Auto(mtbf_s=300.0, history=history)
    auto.should_save(stats(1, now_s=100.0))
    d = auto.take_decision()
    assert d is not None and d["cost_s"] == pytest.approx(1.0)
    assert d["reason"] == "daly optimum, journal history save cost"
    only_blocking = Auto(mtbf_s=300.0, history=history[:2])
    only_blocking.should_save(stats(1, now_s=100.0))
    assert only_blocking.last_decision["cost_s"] == pytest.approx(0.02)
