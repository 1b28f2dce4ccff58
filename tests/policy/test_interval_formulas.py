"""Young/Daly formulas, the waste model and MTBF estimation from journal events."""

from __future__ import annotations

import math

import pytest

from flashckpt.errors import ConfigError
from flashckpt.policy import (
    crash_history,
    estimate_mtbf_s,
    expected_waste_fraction,
    optimal_interval_s,
    young_interval_s,
)


@pytest.mark.parametrize("ratio", [1e-6, 1e-4, 1e-3])
def test_daly_reduces_to_young_for_small_cost(ratio: float) -> None:
    mtbf = 86_400.0
    cost = ratio * mtbf
    young = math.sqrt(2 * cost * mtbf)
    assert young_interval_s(cost, mtbf) == pytest.approx(young)
    daly = optimal_interval_s(cost, mtbf)
    assert daly != young  # the higher-order terms are there...
    assert daly == pytest.approx(young, rel=3 * math.sqrt(ratio))  # ...and vanish as C/M -> 0


@pytest.mark.parametrize("cost", [2 * 3600.0, 5 * 3600.0, 1e9])
def test_daly_is_mtbf_when_cost_at_least_twice_mtbf(cost: float) -> None:
    assert optimal_interval_s(cost, 3600.0) == 3600.0


def test_daly_matches_published_value() -> None:
    # C = 5 min, M = 24 h: sqrt(2CM) = 7200, x = C/2M = 1/576, so
    # τ = 7200·(1 + 1/72 + 1/5184) − 300 = 7001.39 s (Young alone says 7200 s).
    c, m = 300.0, 86_400.0
    x = c / (2 * m)
    expected = math.sqrt(2 * c * m) * (1 + math.sqrt(x) / 3 + x / 9) - c
    assert optimal_interval_s(c, m) == pytest.approx(expected, rel=1e-12)
    assert optimal_interval_s(c, m) == pytest.approx(7001.389, abs=0.01)


@pytest.mark.parametrize(
    ("cost", "mtbf", "restart"), [(10, 3600, 0), (60, 14_400, 120), (600, 7200, 300)]
)
def test_daly_optimum_minimises_the_exact_waste(cost: float, mtbf: float, restart: float) -> None:
    best = optimal_interval_s(cost, mtbf)
    grid = [best * f for f in (0.25, 0.5, 0.8, 0.9, 1.1, 1.25, 2, 4)]
    w_best = expected_waste_fraction(best, cost_s=cost, mtbf_s=mtbf, restart_s=restart)
    for tau in grid:
        assert w_best < expected_waste_fraction(tau, cost_s=cost, mtbf_s=mtbf, restart_s=restart)
    # and the numeric argmin agrees with Daly's closed form within 1%
    taus = [best * (0.5 + i / 1000) for i in range(1001)]
    argmin = min(
        taus, key=lambda t: expected_waste_fraction(t, cost_s=cost, mtbf_s=mtbf, restart_s=restart)
    )
    assert argmin == pytest.approx(best, rel=0.01)


def test_waste_models_agree_when_everything_is_small() -> None:
    kw = {"cost_s": 1.0, "mtbf_s": 1e6, "restart_s": 10.0}
    first = expected_waste_fraction(1000.0, model="first_order", **kw)
    assert first == pytest.approx(1 / 1000 + 1000 / 2e6 + 10 / 1e6)
    assert expected_waste_fraction(1000.0, **kw) == pytest.approx(first, rel=0.01)
    assert expected_waste_fraction(1e9, **kw) == 1.0  # overflow -> all waste
    assert expected_waste_fraction(1e5, cost_s=1e5, mtbf_s=1.0, model="first_order") == 1.0


@pytest.mark.parametrize(
    ("call", "name"),
    [
        (lambda: optimal_interval_s(-1, 10), "cost_s"),
        (lambda: optimal_interval_s(1, 0), "mtbf_s"),
        (lambda: optimal_interval_s(1, math.inf), "mtbf_s"),
        (lambda: optimal_interval_s(True, 10), "cost_s"),
        (lambda: expected_waste_fraction(0, cost_s=1, mtbf_s=10), "interval_s"),
        (lambda: expected_waste_fraction(1, cost_s=1, mtbf_s=10, restart_s=-1), "restart_s"),
        (lambda: expected_waste_fraction(1, cost_s=1, mtbf_s=10, model="x"), "model"),  # type: ignore[arg-type]
        (lambda: estimate_mtbf_s([], prior_s=0), "prior_s"),
        (lambda: estimate_mtbf_s([], prior_s=10, prior_weight=0), "prior_weight"),
    ],
)
def test_bad_arguments_name_themselves(call, name: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ConfigError, match=name):
        call()


def _history(fail_gaps: list[float], *, restart: float = 60.0) -> list[dict]:
    events: list[dict] = [{"t": 0.0, "event": "run_start", "clean_previous": True, "pid": 1}]
    t = 0.0
    for gap in fail_gaps:
        t += gap
        events.append({"t": t, "event": "staged", "step": 1, "blocking_s": 2.0})
        crashed_at = t
        t += restart
        events += [  # in the order RunMarker.start journals them
            {"t": t, "event": "crash_detected", "since_t": crashed_at, "last_step": 1},
            {"t": t, "event": "run_start", "clean_previous": False},
        ]
    return events


def test_crash_history_counts_uptime_failures_and_gaps() -> None:
    hist = crash_history(_history([100.0, 300.0]))
    assert (hist.failures, hist.runs) == (2, 3)
    assert hist.uptime_s == pytest.approx(400.0)
    assert hist.gaps_s == pytest.approx((60.0, 60.0))


def test_crash_history_ends_a_crashed_run_at_its_last_sign_of_life() -> None:
    """The crashed run journaled its last save at t=10 but its run marker was ticked until
    t=40 (``since_t``); the next process started at t=100. Downtime is 60 s, not 90 s: the
    30 s of training after the last save are lost work, not a restart gap. Both pair orders
    (crash_detected first, as RunMarker writes it, or run_start first) give one new run."""
    for pair in (("crash_detected", "run_start"), ("run_start", "crash_detected")):
        events = [
            {"t": 0.0, "event": "run_start", "pid": 7},
            {"t": 10.0, "event": "staged", "step": 5, "blocking_s": 0.1, "pid": 7},
            *(
                {"t": 100.0, "event": name, "since_t": 40.0, "clean_previous": False, "pid": 7}
                for name in pair
            ),
            {"t": 150.0, "event": "run_end", "pid": 7},
        ]
        hist = crash_history(events)
        assert (hist.failures, hist.runs) == (1, 2), pair
        assert hist.gaps_s == pytest.approx((60.0,)), pair
        assert hist.uptime_s == pytest.approx(40.0 + 50.0), pair
    # a since_t outside the crashed run (a stale or foreign marker) is ignored
    for e in events[2:4]:
        e["since_t"] = -5.0
    assert crash_history(events).gaps_s == pytest.approx((90.0,))


def test_crash_history_ignores_other_ranks_and_clean_gaps() -> None:
    events = [
        {"t": 0.0, "event": "run_start", "rank": 0},
        {"t": 0.0, "event": "run_start", "rank": 1},
        {"t": 50.0, "event": "run_end", "rank": 0},
        {"t": 90.0, "event": "crash_detected", "rank": 1},
        {"t": 1000.0, "event": "run_start", "rank": 0, "clean_previous": True},
        {"t": 1010.0, "event": "step_time", "rank": 0, "seconds": 1.0},
        {"t": "bad", "event": "step_time"},
    ]
    hist = crash_history(events)
    assert (hist.failures, hist.runs, hist.gaps_s) == (0, 2, ())
    assert hist.uptime_s == pytest.approx(60.0)


def test_estimate_mtbf_blends_prior_as_one_interval() -> None:
    assert estimate_mtbf_s([], prior_s=3600.0) == 3600.0
    events = _history([100.0, 300.0])
    assert estimate_mtbf_s(events, prior_s=3600.0) == pytest.approx((3600 + 400) / 3)
    assert estimate_mtbf_s(events, prior_s=3600.0, prior_weight=1e-9) == pytest.approx(200.0)
    many = _history([1000.0] * 200)
    assert estimate_mtbf_s(many, prior_s=10.0) == pytest.approx(1000.0, rel=0.01)
