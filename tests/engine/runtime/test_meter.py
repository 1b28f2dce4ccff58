"""The save cost the policy sees (engine/runtime/meter.py): blocking plus what the save added to the
steps it was in flight for, against the median clean step."""

from __future__ import annotations

import pytest
import torch

import flashckpt
from flashckpt.engine.runtime.meter import RunMeter


def _run(meter: RunMeter, steps: list[float], t: float = 0.0, step: int = 0) -> tuple[float, int]:
    for dt in steps:
        t += dt
        step += 1
        meter.tick(step, t)
    return t, step


def _spy(seen: list):
    """A save policy that records the save cost it is shown and never saves."""

    class Spy(flashckpt.policy.EverySteps):
        def should_save(self, stats):
            seen.append(stats.save_cost_s)
            return False

    return Spy


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
    from flashckpt.engine.runtime import cadence

    clock = {"t": 1000.0}
    monkeypatch.setattr(cadence.time, "time", lambda: clock["t"])
    seen: list = []
    Spy = _spy(seen)
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


def test_a_save_costs_its_promotion_too() -> None:
    """Regression: the cost ended when the save was durable in the memory tier, so the copy to
    disk that followed (read back, verify, write, fsync: on a busy CPU as much as the save)
    slowed steps no save was charged for, and Auto saved too often for the real cost."""
    import threading

    m = RunMeter()
    t, step = _run(m, [1.0] * 5)
    m.saved(step, t)
    promoted = threading.Event()
    t, step = _run(m, [1.2], t, step)
    m.durable(blocking_s=0.05, background_s=1.0, until=promoted)
    t, step = _run(m, [1.5, 1.5], t, step)  # promoting: not final yet
    assert m.stats(step, t).save_cost_s is None
    promoted.set()
    t, step = _run(m, [1.1, 1.0], t, step)  # the interval that saw the promotion end
    assert m.stats(step, t).save_cost_s == pytest.approx(0.2 + 0.5 + 0.5 + 0.1)
    assert m._flight is None and m._until is None


def test_a_promotion_still_running_at_the_next_save_charges_what_it_added_so_far() -> None:
    import threading

    m = RunMeter()
    t, step = _run(m, [1.0] * 5)
    m.saved(step, t)
    t, step = _run(m, [1.3], t, step)
    m.durable(blocking_s=0.05, background_s=1.0, until=threading.Event())  # never set
    t, step = _run(m, [1.4], t, step)
    m.saved(step, t)  # the next save overtakes it
    assert m.stats(step, t).save_cost_s == pytest.approx(0.3 + 0.4)


def test_checkpointer_charges_a_save_until_its_promotion_ended(tmp_path, monkeypatch) -> None:
    """Through the public API: a memory tier and a disk tier whose promotion is held until the
    test lets it go; the steps in between are charged to the save."""
    import threading

    from flashckpt.engine.runtime import cadence
    from flashckpt.engine.tiers import tiercopy

    clock = {"t": 1000.0}
    monkeypatch.setattr(cadence.time, "time", lambda: clock["t"])
    gate = threading.Event()
    real_copy = tiercopy.copy_step

    def held_copy(*args, **kwargs):
        assert gate.wait(30)
        return real_copy(*args, **kwargs)

    from flashckpt.engine.tiers import promote

    monkeypatch.setattr(promote, "copy_step", held_copy)
    seen: list = []
    Spy = _spy(seen)
    state = {"w": torch.randn(64 * 1024)}
    with flashckpt.Checkpointer(
        tmp_path / "root", memory_tier=tmp_path / "mem", async_save=True, save_policy=Spy(10**9)
    ) as ck:
        for step in range(1, 6):
            clock["t"] += 0.1
            ck.should_save(step)
        ck.save(5, state)
        ck.wait()  # durable in memory; the promotion waits for the gate
        for step in (6, 7):
            clock["t"] += 0.6
            ck.should_save(step)
        assert seen[-1] is None  # still promoting: no cost yet
        gate.set()
        assert ck.wait_promoted(30)
        clock["t"] += 0.1
        ck.should_save(8)
    assert seen[-1] == pytest.approx(0.5 + 0.5, abs=0.01)
