"""Auto against simulated failure histories: its waste is close to the analytic minimum.

The simulator follows Daly's (2006) model: exponential failures (seeded RNG) that can strike
during steps, saves and restarts; a failure loses the work since the last committed save and
costs ``R`` seconds of restart. Each restart builds a fresh policy from the journal so far, as a
real restarted process would.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import Any

import pytest

from flashckpt.policy import (
    Auto,
    EverySteps,
    RunStats,
    SavePolicy,
    expected_waste_fraction,
    optimal_interval_s,
)

DT, COST, RESTART, MTBF = 60.0, 60.0, 120.0, 4 * 3600.0
WORK_STEPS = 48_000  # 200 MTBFs of useful work

Factory = Callable[[Sequence[dict[str, Any]]], SavePolicy]


def simulate(factory: Factory, *, seed: int) -> tuple[float, list[dict[str, Any]]]:
    """Run ``WORK_STEPS`` steps of ``DT`` seconds under ``factory``'s policy; return
    (waste fraction = 1 − useful time / wall time, journal events)."""
    rng = random.Random(seed)
    t, committed, run_start_t = 0.0, 0, 0.0
    next_fail = rng.expovariate(1 / MTBF)
    events: list[dict[str, Any]] = [{"t": 0.0, "event": "run_start", "clean_previous": True}]
    while True:
        policy = factory(events)
        step, last_step, last_s, measured = committed, committed or None, None, None
        while step < WORK_STEPS and next_fail >= t + DT:
            t, step = t + DT, step + 1
            stats = RunStats(
                step=step,
                now_s=t,
                last_save_step=last_step,
                last_save_s=last_s,
                step_time_s=DT,
                save_cost_s=measured,
                persist_s=None,
            )
            save = policy.should_save(stats)
            decision = policy.take_decision()
            if decision is not None:
                events.append({"t": t, "event": "interval", **decision})
            if save:
                if next_fail < t + COST:
                    break
                t += COST
                committed, last_step, last_s, measured = step, step, t, COST
                events.append({"t": t, "event": "staged", "step": step, "blocking_s": COST})
        if step >= WORK_STEPS:
            return 1.0 - WORK_STEPS * DT / t, events
        t = next_fail
        events.append({"t": t, "event": "step_time", "step": step, "seconds": DT})
        while True:  # restart R, which a failure can interrupt too
            next_fail = t + rng.expovariate(1 / MTBF)
            if next_fail >= t + RESTART:
                t += RESTART
                break
            t = next_fail
        events.append({"t": t, "event": "run_start", "clean_previous": False})
        events.append(
            {"t": t, "event": "crash_detected", "last_step": step, "since_t": run_start_t}
        )
        run_start_t = t


def analytic_min() -> float:
    return expected_waste_fraction(
        optimal_interval_s(COST, MTBF), cost_s=COST, mtbf_s=MTBF, restart_s=RESTART
    )


@pytest.fixture(scope="module")
def grid() -> dict[int, float]:
    """Simulated waste of fixed intervals (in steps), same failure seed as Auto."""
    return {k: simulate(lambda _e, k=k: EverySteps(k), seed=7)[0] for k in (3, 8, 22, 60, 180)}


def test_fixed_grid_is_u_shaped_and_matches_daly(grid: dict[int, float]) -> None:
    best_k = min(grid, key=grid.__getitem__)
    assert best_k == 22, grid
    assert grid[3] > 1.5 * grid[22] and grid[180] > 1.5 * grid[22], grid
    for k, waste in grid.items():  # the exact Daly model predicts the simulation
        expected = expected_waste_fraction(k * DT, cost_s=COST, mtbf_s=MTBF, restart_s=RESTART)
        assert waste == pytest.approx(expected, rel=0.15), (k, waste, expected)


@pytest.mark.parametrize("prior_mtbf_s", [MTBF / 4, MTBF, MTBF * 4])
def test_auto_waste_close_to_analytic_minimum(grid: dict[int, float], prior_mtbf_s: float) -> None:
    def factory(events: Sequence[dict[str, Any]]) -> SavePolicy:
        return Auto(mtbf_s=prior_mtbf_s, restart_s=RESTART, history=events)

    waste, events = simulate(factory, seed=7)
    assert waste <= analytic_min() * 1.12, (waste, analytic_min())
    assert waste <= min(grid.values()) * 1.10, (waste, grid)
    # It learned the MTBF from the crash history, starting from a prior 4x off.
    last = [e for e in events if e["event"] == "interval"][-1]
    assert last["mtbf_s"] == pytest.approx(MTBF, rel=0.2)
    assert last["interval_steps"] in range(19, 26)
    assert last["reason"].startswith("daly optimum")


def test_auto_with_wrong_prior_beats_a_fixed_guess() -> None:
    """Without learning (a huge prior weight) a 4x wrong MTBF prior costs measurably more."""

    def stubborn(events: Sequence[dict[str, Any]]) -> SavePolicy:
        return Auto(mtbf_s=MTBF / 16, restart_s=RESTART, prior_weight=1e9, history=events)

    def learning(events: Sequence[dict[str, Any]]) -> SavePolicy:
        return Auto(mtbf_s=MTBF / 16, restart_s=RESTART, history=events)

    assert simulate(learning, seed=3)[0] < simulate(stubborn, seed=3)[0] * 0.92
