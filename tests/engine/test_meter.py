"""The save cost the policy sees (engine/meter.py): blocking plus what the save added to the
steps it was in flight for, against the median clean step."""

from __future__ import annotations

import pytest
import torch

import flashckpt
from flashckpt.engine.meter import RunMeter


def _run(meter: RunMeter, steps: list[float], t: float = 0.0, step: int = 0) -> tuple[float, int]:
    for dt in steps:
        t += dt
        step += 1
        meter.tick(step, t)
    return t, step


def test_a_save_costs_what_it_added_to_the_steps_in_flight() -> None:
    """Regression: the policy saw only the seconds save() blocked (0.05 s), while the
    background persist slowed each of the next three 1.0 s steps to 1.4 s: a save cost 1.25 s,
    and Auto, given 0.05 s, chose an interval 5x too short."""
    m = RunMeter()
    t, step = _run(m, [1.0] * 5)  # clean steps: median 1.0
    m.saved(step, t)
    t, step = _run(m, [1.05, 1.4, 1.4], t, step)  # the first holds save()'s 0.05 s blocking
    m.durable(blocking_s=0.05, background_s=2.0)
    assert m.stats(step, t).save_cost_s is None  # not final before a tick sees the end
    t, step = _run(m, [1.4, 1.0], t, step)  # the interval in which it became durable
    assert m.stats(step, t).save_cost_s == pytest.approx(0.05 + 0.4 * 3)
    assert m.stats(step, t).persist_s == pytest.approx(2.0)


def test_without_clean_steps_or_ticks_a_save_costs_its_blocking() -> None:
    m = RunMeter()
    m.saved(0, 0.0)
    m.durable(blocking_s=0.3, background_s=1.0)
    m.saved(1, 5.0)  # no tick saw the first one end
    assert m.stats(1, 5.0).save_cost_s == pytest.approx(0.3)
    m2 = RunMeter()
    m2.tick(1, 0.0)
    m2.saved(1, 0.0)
    _run(m2, [2.0, 2.0], 0.0, 1)  # in flight from the start: no clean median
    m2.durable(blocking_s=0.2, background_s=1.0)
    _run(m2, [2.0], 4.0, 3)
    assert m2.stats(4, 6.0).save_cost_s == pytest.approx(0.2)
    _run(m2, [2.0], 6.0, 4)
    assert list(m2._clean) == [2.0] and m2._flight is None  # the next interval is clean


def test_a_restore_is_not_a_save_in_flight() -> None:
    m = RunMeter()
    m.saved(10, 0.0, started=False)
    _run(m, [1.0, 1.0], 0.0, 10)
    assert m._flight is None and len(m._clean) == 1


def test_checkpointer_feeds_the_policy_the_slowdown_of_steps_while_persisting(
    tmp_path, monkeypatch
) -> None:
    """Through the public API (should_save each step, an async save): clean steps of 0.1 s,
    then the save, then a step of 1.1 s in which it became durable: the policy is told the
    save cost 1 s, not the milliseconds save() blocked."""
    from flashckpt.engine import cadence

    clock = {"t": 1000.0}
    monkeypatch.setattr(cadence.time, "time", lambda: clock["t"])
    seen: list = []

    class Spy(flashckpt.policy.EverySteps):
        def should_save(self, stats):
            seen.append(stats.save_cost_s)
            return False

    state = {"w": torch.randn(256 * 1024)}
    with flashckpt.Checkpointer(tmp_path, async_save=True, save_policy=Spy(10**9)) as ck:
        for step in range(1, 6):
            clock["t"] += 0.1
            ck.should_save(step)
        handle = ck.save(5, state)
        ck.wait()
        for step in (6, 7):
            clock["t"] += 1.1 if step == 6 else 0.1
            ck.should_save(step)
    assert seen[-1] == pytest.approx(1.0) and seen[-1] > handle.blocking_s
