"""Run summary numbers, goodput and cost from the journal; journal robustness."""

from __future__ import annotations

import json
import multiprocessing as mp
from pathlib import Path
from typing import Any

import pytest

from flashckpt.errors import ConfigError
from flashckpt.journal import Journal
from flashckpt.report import load_events, save_records, summarize


def test_summary_counts(events: list[dict[str, Any]]) -> None:
    s = summarize(events)
    assert (s.saves, s.saves_failed, s.crashes, s.restores, s.runs) == (10, 1, 1, 1, 2)
    assert s.steps_lost == 70 and s.lost_s == pytest.approx(35.0)
    assert s.last_step == 1001 and s.last_durable_step == 1000
    assert s.restore_s == 12.0 and s.step_time_s == 0.5
    assert 0.3 <= s.mean_blocking_s <= 0.5 and s.max_blocking_s <= 0.5  # type: ignore[operator]
    assert 9.0 < s.mean_durable_s < 13.0  # type: ignore[operator]
    assert s.bytes_new + s.bytes_reused == pytest.approx(10 * 3.1e9)
    assert s.raw_Bps == 2.0e9 and s.interval_s == 65.0
    assert s.cost is None and s.wasted_cost is None


def test_goodput_definition(events: list[dict[str, Any]]) -> None:
    s = summarize(events, gpu_hour_price=2.0, gpus=8)
    # the crashed run's last event is step 450's last memory record; its run marker says it was
    # alive until step 470, and the next run starts 95 s after that: the gap is the downtime
    # alone (steps 401-470 are counted once, as lost work)
    assert s.restart_gap_s == pytest.approx(95.0, abs=0.01)
    ts = [e["t"] for e in events]
    assert s.wall_s == pytest.approx(max(ts) - min(ts))  # no clean gaps here
    useful = s.wall_s - s.blocking_s - s.restore_s - s.lost_s - s.restart_gap_s
    assert s.useful_s == pytest.approx(useful)
    assert s.goodput == pytest.approx(useful / s.wall_s)
    assert 0.7 < s.goodput < 0.8  # type: ignore[operator]
    assert s.cost == pytest.approx(s.wall_s / 3600 * 2.0 * 8)
    assert s.wasted_cost == pytest.approx(s.cost * (1 - s.goodput))  # type: ignore[operator]


def test_clean_restart_gap_is_not_waste() -> None:
    evs = [
        {"t": 0.0, "event": "run_start"},
        {"t": 100.0, "event": "run_end", "step": 10},
        {"t": 10_000.0, "event": "run_start", "clean_previous": True},
        {"t": 10_100.0, "event": "run_end", "step": 20},
    ]
    s = summarize(evs)
    assert s.wall_s == 200.0 and s.goodput == 1.0 and s.restart_gap_s == 0.0


def test_lost_steps_fallback_and_rank_dedup() -> None:
    evs = []
    for rank in (0, 1, 2, 3):
        evs += [
            {"t": 0.0, "event": "run_start", "rank": rank},
            {"t": 1.0, "event": "step_time", "seconds": 2.0, "rank": rank},
            {"t": 5.0, "event": "save_start", "step": 3, "rank": rank},
            {"t": 6.0, "event": "staged", "step": 3, "blocking_s": 1.0, "rank": rank},
            {"t": 50.0, "event": "run_start", "clean_previous": False, "rank": rank},
            {"t": 50.0, "event": "crash_detected", "last_step": 9, "rank": rank},
            {"t": 51.0, "event": "restore", "step": 3, "seconds": 1.0, "rank": rank},
        ]
    s = summarize(evs)
    assert (s.saves, s.crashes, s.gpus) == (1, 1, 4)
    assert s.steps_lost == 6 and s.lost_s == 12.0
    assert s.restart_gap_s == 44.0 and s.blocking_s == 1.0


def test_save_records_time_to_durable_is_slowest_tier(events: list[dict[str, Any]]) -> None:
    rec = save_records(events)[0]
    assert rec.step == 100 and rec.tiers == ("memory", "local")
    assert rec.durable_s is not None and rec.durable_s > 9.0 + rec.blocking_s  # type: ignore[operator]
    assert rec.new_bytes == 3.1e9 and rec.reused_bytes == 0.0


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"gpu_hour_price": -1}, "gpu_hour_price"),
        ({"gpu_hour_price": "x"}, "gpu_hour_price"),
        ({"gpus": 0}, "gpus"),
    ],
)
def test_bad_summary_arguments(kw: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        summarize([], **kw)


def test_empty_summary() -> None:
    s = summarize([])
    assert s.events == 0 and s.goodput is None and s.saves == 0


def test_torn_last_line_is_tolerated(root: Path, events: list[dict[str, Any]]) -> None:
    with open(root / "journal.jsonl", "ab") as f:
        f.write(b'[1, 2]\n{"no_event": 1}\n\xff\xfe garbage\n{"t": 1700000999.0, "event": "dur')
    assert len(load_events(root)) == len(events)
    assert summarize(load_events(root)).saves == 10


def _append_many(path: str, n: int) -> None:
    j = Journal(path)
    for i in range(n):
        j.append("step_time", step=i, seconds=0.001, pad="x" * 300)


def test_journal_appends_from_processes_never_interleave(tmp_path: Path) -> None:
    path = tmp_path / "journal.jsonl"
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_append_many, args=(str(path), 200)) for _ in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=60)
    assert all(p.exitcode == 0 for p in procs)
    lines = path.read_bytes().splitlines()
    assert len(lines) == 800
    assert all(json.loads(line)["event"] == "step_time" for line in lines)
    assert len({json.loads(line)["pid"] for line in lines}) == 4


def _durable(t: float, step: int, rank: int, new: float, tier: str = "local") -> dict[str, Any]:
    return {
        "t": t,
        "event": "durable",
        "step": step,
        "rank": rank,
        "tier": tier,
        "background_s": 2.0 if rank == 0 else 4.0,
        "total_bytes": 2 * new,
        "new_bytes": new,
        "reused_bytes": new,
        "throughput_Bps": new / 2.0,
    }


def test_bytes_are_summed_over_ranks_and_saves_counted_once() -> None:
    evs: list[dict[str, Any]] = []
    for step, t in ((10, 0.0), (20, 10.0)):
        for rank in (0, 1):
            evs += [
                {"t": t, "event": "save_start", "step": step, "rank": rank},
                {"t": t + 0.1, "event": "staged", "step": step, "blocking_s": 0.1, "rank": rank},
            ]
        evs.append(_durable(t + 2, step, 0, 341_000.0))  # rank 0 owns fewer bytes ...
        evs.append(_durable(t + 4, step, 1, 341_000.0 * 1.5))  # ... than rank 1
        evs.append(_durable(t + 5, step, 0, 341_000.0, tier="remote"))  # promotion: not counted
    s = summarize(evs)
    assert s.saves == 2 and s.gpus == 2
    assert s.bytes_new == 2 * 341_000.0 * 2.5 and s.bytes_reused == s.bytes_new
    recs = save_records(evs)
    assert [r.ranks for r in recs] == [2, 2]
    assert recs[0].total_bytes == 2 * 341_000.0 * 2.5
    assert recs[0].throughput_Bps == 341_000.0 * 2.5 / 4.0  # all new bytes over the slowest rank


def test_restore_counted_once_however_many_parts() -> None:
    # the HF integration restores one step in four parts (state, model, optim+sched, rng)
    evs: list[dict[str, Any]] = [{"t": 0.0, "event": "run_start", "pid": 7}]
    evs += [
        {"t": 1.0 + i, "event": "restore", "step": 8, "seconds": 0.5, "pid": 7} for i in range(4)
    ]
    evs += [{"t": 9.0, "event": "save_start", "step": 12, "pid": 7}]
    evs += [{"t": 10.0, "event": "restore", "step": 12, "seconds": 1.0, "pid": 7}]  # a new one
    s = summarize(evs)
    assert s.restores == 2 and s.restore_s == 3.0


def test_steps_lost_counts_step_ticks_past_the_marker() -> None:
    # the loop saved at step 10 and trained on to step 17, calling should_save only on saves:
    # the run marker (crash_detected.last_step) and the engine's steps_lost say 10, the step
    # ticks say 17
    evs: list[dict[str, Any]] = [{"t": 0.0, "event": "run_start"}]
    evs += [{"t": 1.0, "event": "save_start", "step": 10}]
    evs += [{"t": 2.0 + i, "event": "step", "step": 11 + i} for i in range(7)]
    evs += [
        {"t": 50.0, "event": "crash_detected", "last_step": 10, "since_t": 9.0},
        {"t": 50.0, "event": "run_start", "clean_previous": False},
        {"t": 51.0, "event": "restore", "step": 10, "seconds": 1.0},
        {"t": 51.0, "event": "steps_lost", "from_step": 11, "to_step": 10, "steps": 0},
    ]
    assert summarize(evs).steps_lost == 7
    without_ticks = [e for e in evs if e["event"] != "step"]
    assert summarize(without_ticks).steps_lost == 0  # what the marker alone knows
