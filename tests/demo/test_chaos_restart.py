"""The chaos stats time a restart from the driver's kill; the journal gives its own figures and
parts beside it."""

from __future__ import annotations

import pytest

from flashckpt.demo.chaos_stats import analyze


def _log() -> list[dict]:
    """Run 1 (pid 1): steps 1-10, killed at t=12; run 2 (pid 2) restores 8, steps from t=15."""

    def start(pid: int, step: int, t: float) -> dict:
        return {"event": "start", "pid": pid, "step": step, "t_proc": t, "t_imported": t + 1.0,
                "t_restore": t + 1.5, "t_restored": t + 2.0}  # fmt: skip

    def steps(a: int, b: int, t: float) -> list[dict]:
        return [{"event": "step", "step": s, "t": t + (s - a + 1), "compute_s": 1.0,
                 "blocked_s": 0.0} for s in range(a, b + 1)]  # fmt: skip

    return [start(1, 0, 0.0), *steps(1, 10, 0.0), start(2, 8, 12.0), *steps(9, 15, 14.0)]


JOURNAL = [
    {"t": 1.0, "event": "restart", "pid": 1, "restart_seconds": 99.0},  # not a resumed process
    {"t": 15.1, "event": "restart", "pid": 2, "restart_seconds": 3.2, "killed_t": 11.9,
     "down_s": 0.2, "start_s": 1.5, "restore_s": 0.5, "first_step_s": 1.0},
]  # fmt: skip


def test_the_restart_is_timed_from_the_kill_and_the_journal_is_kept_beside_it() -> None:
    """The journal's 3.2 s starts at the killed run's last tick (11.9), before the kill (12.0):
    the driver's kill -> first step (15.0) is the restart."""
    res = analyze(_log(), kills=[12.0], t0=0.0, t_end=25.0, journal=JOURNAL)
    assert res.restart_s == [pytest.approx(3.0)] and res.restart_journaled == 1
    assert res.journal_restart_s == [3.2]
    assert res.journal_restart_parts_s == pytest.approx(
        {"down": 0.2, "start": 1.5, "restore": 0.5, "first_step": 1.0}
    )
    assert res.restart_parts_s["imports"] == pytest.approx(1.0)  # the log's finer split stays


def test_without_a_journal_the_log_times_the_restart() -> None:
    res = analyze(_log(), kills=[12.0], t0=0.0, t_end=25.0)
    assert res.restart_s == [pytest.approx(3.0)] and res.restart_journaled == 0
    assert res.journal_restart_parts_s == {} and res.journal_restart_s == []


def test_a_journaled_restart_spanning_two_failures_is_not_used() -> None:
    """Kills at 6 and 12: the process started at 6 died before opening its Checkpointer, so
    the journal's kill instant is the first run's last sign of life (before 6)."""
    journal = [{**JOURNAL[1], "killed_t": 5.5, "restart_seconds": 9.6}]
    res = analyze(_log(), kills=[6.0, 12.0], t0=0.0, t_end=25.0, journal=journal)
    assert res.restart_s == [pytest.approx(3.0)]  # the log's: kill at 12 -> step at 15
    assert res.restart_journaled == 0 and res.journal_restart_parts_s == {}
    assert res.journal_restart_s == []


def test_a_standby_run_is_timed_from_the_kill_before_its_first_step() -> None:
    """flashckpt_standby: the standby process started at t=5 (before the kill at 12), its
    restore() returned at 12.4, its first step at 13.0: a 1.0 s restart, all but the first step
    in restore; the kill is not the one before its process start (none here)."""
    log = _log()[:11]
    log.append({"event": "start", "pid": 2, "step": 8, "t_proc": 5.0, "t_imported": 6.0,
                "t_restore": 7.0, "t_restored": 12.4, "standby": True})  # fmt: skip
    log += [{"event": "step", "step": s, "t": 13.0 + (s - 9), "compute_s": 1.0, "blocked_s": 0.0}
            for s in range(9, 15)]  # fmt: skip
    res = analyze(log, kills=[12.0], t0=0.0, t_end=25.0)
    assert res.restart_s == [pytest.approx(1.0)]
    assert res.restart_parts_s["process"] == 0.0 and res.restart_parts_s["build"] == 0.0
    assert res.restart_parts_s["restore"] == pytest.approx(0.4)
    assert res.restart_parts_s["first_step"] == pytest.approx(0.6)
