"""The governor (engine/runtime/governor.py): each async save runs the way its recent saves
cost the loop less, background within the budget, the other way measured again now and then."""

from __future__ import annotations

import itertools
import json
import time

import pytest
import torch

import flashckpt
from flashckpt.engine.runtime.governor import BACKGROUND, FOREGROUND, Governor
from flashckpt.errors import ConfigError
from flashckpt.journal import Journal


def _run(gov: Governor, costs: list[float]) -> list[str]:
    """Feed one measured cost per save; the mode each save ran in."""
    gov.tick()  # a step timed before the first save: the costs below are measurements
    ran = []
    for step, cost in enumerate(costs, 1):
        ran.append(gov.started(step))
        with gov._lock:  # what the meter does when the save's cost is final
            gov._settled(cost)
    return ran


def test_the_second_save_measures_the_foreground_and_the_cheaper_mode_wins() -> None:
    gov = Governor(probe_every=100)
    # background costs 0.5 s a save, a foreground save 0.2 s: the loop is better off waiting
    ran = _run(gov, [0.5, 0.2, 0.2, 0.2])
    assert ran == [BACKGROUND, FOREGROUND, FOREGROUND, FOREGROUND]
    assert gov.last["why"].startswith("background cost 0.500s > budget 0.200s")


def test_a_cheap_background_stays_background() -> None:
    gov = Governor(probe_every=100)
    ran = _run(gov, [0.05, 0.4, 0.05, 0.06, 0.05])
    assert ran == [BACKGROUND, FOREGROUND, BACKGROUND, BACKGROUND, BACKGROUND]


def test_the_other_mode_is_measured_again_every_probe_every_saves() -> None:
    gov = Governor(probe_every=3)
    # the host quiets down: background got cheap, but only a probe can see it
    ran = _run(gov, [0.9, 0.2, 0.2, 0.2, 0.01, 0.01, 0.01])
    assert ran[:2] == [BACKGROUND, FOREGROUND]
    assert BACKGROUND in ran[2:5], ran  # probed within probe_every saves
    assert ran[-1] == BACKGROUND


def test_a_given_budget_replaces_the_foreground_probe() -> None:
    gov = Governor(budget_s=0.1, probe_every=100)
    ran = _run(gov, [0.05, 0.3, 0.3])
    assert ran == [BACKGROUND, BACKGROUND, FOREGROUND]
    assert gov.last["budget_s"] == 0.1


def test_decisions_are_journaled_and_a_disabled_governor_is_silent(tmp_path) -> None:
    journal = Journal(tmp_path / "journal.jsonl")
    gov = Governor(journal=journal, probe_every=100)
    _run(gov, [0.5, 0.2])
    events = [json.loads(x) for x in (tmp_path / "journal.jsonl").read_text().splitlines()]
    gov_events = [e for e in events if e["event"] == "governor"]
    assert [e["ran"] for e in gov_events] == [BACKGROUND, FOREGROUND]
    assert gov_events[-1]["next"] == FOREGROUND and gov_events[-1]["foreground_cost_s"] == 0.2
    off = Governor(journal=Journal(tmp_path / "off.jsonl"), enabled=False)
    assert _run(off, [0.5, 0.2, 0.2]) == [BACKGROUND] * 3
    assert (
        not (tmp_path / "off.jsonl").exists()
        or "governor" not in (tmp_path / "off.jsonl").read_text()
    )


def _loop(ck: flashckpt.Checkpointer, steps: int, every: int) -> None:
    model = torch.nn.Linear(256, 256)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    state = {"model": model, "optim": opt}
    for step in range(1, steps + 1):
        model(torch.randn(8, 256)).sum().backward()
        opt.step()  # the pre-step hook ticks the governor's clock
        opt.zero_grad()
        time.sleep(0.002)
        if step % every == 0:
            ck.save(step, state)


def test_a_checkpointer_journals_governor_decisions_and_status_shows_them(tmp_path) -> None:
    from flashckpt.report.summary import summarize
    from flashckpt.report.terminal import format_status

    with flashckpt.Checkpointer(tmp_path / "root", async_save=True) as ck:
        _loop(ck, steps=70, every=5)  # (a clear background: the probe by save 10)
    events = [json.loads(x) for x in (tmp_path / "root" / "journal.jsonl").read_text().splitlines()]
    decisions = [e for e in events if e["event"] == "governor"]
    assert decisions, "no governor decision journaled"
    assert {e["ran"] for e in decisions} == {BACKGROUND, FOREGROUND}  # the probe ran
    s = summarize(events)
    assert s.governor_mode in (BACKGROUND, FOREGROUND)
    assert "next save" in format_status(s)


def test_a_foreground_save_returns_durable_and_governor_false_never_waits(tmp_path) -> None:
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    state = {"model": model, "optim": opt}
    with flashckpt.Checkpointer(tmp_path / "a", async_save=True) as ck:
        ck._saver.governor.mode = FOREGROUND
        h = ck.save(1, state)
        assert h.durable.done() and h.durable.exception() is None
    with flashckpt.Checkpointer(tmp_path / "b", async_save=True, governor=False) as ck:
        ck._saver.governor.mode = FOREGROUND  # ignored: the governor is off
        assert ck._saver.governor.started(2) == BACKGROUND


@pytest.mark.parametrize("bad", [-1.0, float("nan"), float("inf"), "1s", True])
def test_a_bad_save_budget_is_refused_with_what_to_do(tmp_path, bad) -> None:
    with pytest.raises(ConfigError, match="save_budget_s must be a number of seconds"):
        flashckpt.Checkpointer(tmp_path / "root", async_save=True, save_budget_s=bad)


def test_a_journaled_foreground_cost_replaces_the_probe_after_a_restart() -> None:
    """A restarted process paid a synchronous save, its cold one, as the foreground probe
    after every restart; the newest cost an earlier run of the same rank journaled stands in."""
    events = [
        {"event": "governor", "foreground_cost_s": 0.9},
        {"event": "governor", "foreground_cost_s": 0.3, "rank": 1},  # another rank's
        {"event": "governor", "foreground_cost_s": 0.25},
        {"event": "governor", "foreground_cost_s": None},  # killed before it measured one
        {"event": "governor", "foreground_cost_s": True},  # not a number
    ]
    gov = Governor(probe_every=100)
    gov.observe_history(events)
    assert gov.inherited_s == 0.25
    ran = _run(gov, [0.1, 0.1, 0.6, 0.6])  # no probe: the third makes background dearer
    assert ran == [BACKGROUND, BACKGROUND, BACKGROUND, FOREGROUND]
    assert list(gov.costs[FOREGROUND]) == [0.25, 0.6]  # the inherited cost, then its own
    fresh = Governor(probe_every=100)
    fresh.observe_history([{"event": "governor", "foreground_cost_s": "0.2"}, {"event": "x"}])
    assert fresh.inherited_s is None and _run(fresh, [0.1, 0.1])[1] == FOREGROUND


def test_a_restarted_checkpointer_starts_from_the_journaled_budget(tmp_path) -> None:
    with flashckpt.Checkpointer(tmp_path / "root", async_save=True) as ck:
        _loop(ck, steps=70, every=5)  # (a clear background: the probe by save 10)
        fg = ck._saver.governor.last.get("foreground_cost_s")
    assert fg is not None
    with flashckpt.Checkpointer(tmp_path / "root", async_save=True) as ck:
        assert ck._saver.governor.inherited_s == pytest.approx(fg)


def test_the_first_save_of_a_process_is_not_a_measurement() -> None:
    """The pre-step hook that ticks the governor's meter is installed by the first async save,
    so that save's cost was its blocking alone (0.005 s in every chaos piece, where saves cost
    the loop 0.25 s): counted, it made the background look free."""
    gov = Governor(probe_every=100)
    assert gov.started(1) == BACKGROUND
    with gov._lock:
        gov._settled(0.005)
    assert not gov.costs[BACKGROUND] and gov.last["why"].startswith("not measured")
    gov.tick()  # the hook times the steps from now on
    assert gov.started(2) == BACKGROUND  # measured this time
    with gov._lock:
        gov._settled(0.3)
    assert list(gov.costs[BACKGROUND]) == [0.3]


def _probes(ran: list[str]) -> list[int]:
    return [i for i, mode in enumerate(ran, 1) if mode == FOREGROUND]


def test_probes_grow_rarer_while_the_background_clearly_wins() -> None:
    """A foreground probe is a synchronous save (0.15 s against 0.04 s for a background save on
    the 2-core VM's dispatch loop): one every 8 saves added a third to a save's steady cost.
    Each probe that finds the background at most half the foreground's cost doubles the wait
    for the next, up to probe_max."""
    ran: list[str] = []
    for probe_max in (64, 8):  # 8: the fixed interval of before
        gov = Governor(probe_every=8, probe_max=probe_max)
        gov.tick()
        ran = []
        for step in range(1, 400):
            ran.append(gov.started(step))
            with gov._lock:  # a foreground save costs 0.15 s, a background one 0.04 s
                gov._settled(0.15 if ran[-1] == FOREGROUND else 0.04)
        probes = _probes(ran)
        gaps = [b - a for a, b in itertools.pairwise(probes)]
        if probe_max == 8:
            assert len(probes) >= 40 and set(gaps[1:]) == {8}, gaps
            continue
        assert probes[0] == 2  # the first foreground measurement (the budget)
        assert gaps[0] <= 16 and gaps[1:3] == [32, 64] and set(gaps[3:]) == {64}, gaps
        assert len(probes) <= 8


def test_a_close_answer_or_a_dear_background_brings_the_probes_back() -> None:
    gov = Governor(probe_every=4, probe_max=64)
    gov.tick()

    def save(step: int, bg: float, fg: float) -> str:
        mode = gov.started(step)
        with gov._lock:
            gov._settled(fg if mode == FOREGROUND else bg)
        return mode

    for step in range(1, 40):  # background clearly cheaper: the wait grows
        save(step, 0.04, 0.15)
    assert gov._interval > 4
    step = 40
    while save(step, 0.1, 0.15) != FOREGROUND:  # the host got busier: the next probe...
        step += 1
    save(step + 1, 0.1, 0.15)
    assert gov._interval == 4  # ...finds 0.1 > half of 0.15: probes every 4 again
    for s in range(step + 2, step + 40):
        save(s, 0.04, 0.15)
    assert gov._interval > 4
    save(step + 40, 0.9, 0.15)  # the background goes over the budget at once
    save(step + 41, 0.9, 0.15)
    assert gov.saturated and gov._interval == 4


def _run_timed(gov: Governor, saves: list[tuple[float, float, float]]) -> list[str]:
    """Like ``_run``, each save with its time to durable: (background cost, time to durable,
    foreground cost); the cost charged is the one of the mode it ran in."""
    gov.tick()
    ran = []
    for step, (bg, took, fg) in enumerate(saves, 1):
        mode = gov.started(step)
        ran.append(mode)
        gov.durable(blocking_s=0.0, background_s=took, until=None)
        with gov._lock:
            gov._settled(fg if mode == FOREGROUND else bg)
    return ran


def test_the_first_probe_waits_for_the_schedule_while_the_background_clearly_overlaps() -> None:
    """A foreground probe is a synchronous save. While a background save costs the loop at
    most half its own time to durable (0.04 s of 0.16 s: the dispatch loop), the first probe
    waits for the regular schedule: a 5-save run pays none."""
    gov = Governor(probe_every=8)
    ran = _run_timed(gov, [(0.04, 0.16, 0.15)] * 12)
    assert ran[:8] == [BACKGROUND] * 8 and FOREGROUND in ran[8:10], ran
    assert gov.last["foreground_cost_s"] == 0.15  # measured on schedule
    # the background costs more than half its time to durable: probed at once, as before
    close = Governor(probe_every=8)
    assert _run_timed(close, [(0.1, 0.15, 0.075)] * 3) == [BACKGROUND, FOREGROUND, FOREGROUND]
    # a background over the budget found by that probe: foreground from then on
    assert close.saturated
