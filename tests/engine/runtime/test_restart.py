"""Restart seconds: a run SIGKILLed mid-run and started again journals ``restart`` (kill ->
first resumed step) in parts that sum to the total; a clean previous run journals none."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

import flashckpt
from flashckpt.engine.runtime.restart import IMPORTED_T, RestartClock, process_start_time
from flashckpt.journal import Journal, read_events
from flashckpt.report.prometheus import exposition
from flashckpt.report.summary import summarize
from flashckpt.report.terminal import format_status

TRAINER = textwrap.dedent(
    """
    import sys, time, torch, flashckpt
    ck = flashckpt.Checkpointer(sys.argv[1], save_policy=3)
    w = torch.zeros(4)
    start = ck.restore({"w": w}) or 0
    for step in range(start + 1, int(sys.argv[2]) + 1):
        time.sleep(0.05)
        w += 1
        if ck.should_save(step):
            ck.save(step, {"w": w})
        print(step, flush=True)
    ck.close()
    """
)
PARTS = ("down_s", "start_s", "restore_s", "first_step_s")


def _kill_after(root, step: int) -> float:
    """Run the trainer until it printed ``step``, SIGKILL it; returns the kill time."""
    proc = subprocess.Popen(
        [sys.executable, "-c", TRAINER, str(root), "1000"], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    for line in proc.stdout:
        if int(line) >= step:
            break
    proc.kill()
    killed = time.time()
    assert proc.wait(timeout=60) == -signal.SIGKILL
    return killed


def test_sigkilled_run_journals_restart_in_parts(tmp_path):
    killed = _kill_after(tmp_path, 7)
    spawned = time.time()
    res = subprocess.run(
        [sys.executable, "-c", TRAINER, str(tmp_path), "14"], capture_output=True, timeout=120
    )
    assert res.returncode == 0, res.stderr
    events = read_events(tmp_path)
    (r,) = [e for e in events if e["event"] == "restart"]
    assert r["restored_step"] in (6, 9) and r["step"] == r["restored_step"] + 1  # first resumed
    assert r["start_source"] == "proc"
    assert abs(r["process_t"] - spawned) < 0.5  # /proc/self/stat: when the trainer started
    # the kill instant is the killed run's last sign of life: at most a step before the kill
    assert killed - 1.0 < r["killed_t"] <= killed
    assert all(r[k] is not None and r[k] >= 0 for k in PARTS)
    assert sum(r[k] for k in PARTS) == pytest.approx(r["restart_seconds"], abs=1e-5)
    assert r["down_s"] >= spawned - killed - 0.02  # 10 ms /proc resolution
    assert r["start_s"] > 0.05 and r["first_step_s"] >= 0.05  # imports; one 50 ms step
    (restore,) = [e for e in events if e["event"] == "restore"]
    assert r["restore_s"] >= restore["seconds"]
    assert 0 < r["imported_s"] <= r["ready_s"] <= r["start_s"]
    # status, metrics show it
    s = summarize(events)
    assert s.restarts_timed == 1 and s.last_restart_s == pytest.approx(r["restart_seconds"])
    assert "restart" in format_status(s) and "first step" in format_status(s)
    text = exposition(s)
    assert f"flashckpt_restart_seconds_last {r['restart_seconds']!r}" in text
    assert 'flashckpt_restart_part_seconds_mean{part="restore"}' in text


def test_clean_previous_run_journals_no_restart(tmp_path):
    for _ in range(2):
        with flashckpt.Checkpointer(tmp_path, save_policy=2) as ck:
            w = torch.zeros(2)
            start = ck.restore({"w": w}) or 0
            for step in range(start + 1, start + 3):
                if ck.should_save(step):
                    ck.save(step, {"w": w})
    assert not [e for e in read_events(tmp_path) if e["event"] == "restart"]


def test_restart_without_a_checkpoint_has_no_restore_part(tmp_path):
    clock = RestartClock(Journal(tmp_path / "j.jsonl"), signs_of_life=[None, 100.0, 50.0])
    assert clock.killed_t == 100.0
    clock.process_t = 101.0
    clock.ready_t = 103.0
    clock.restoring()  # found nothing: restored() is never called
    rec = clock.tick(5)
    assert rec is not None and rec["restore_s"] is None and rec["down_s"] == 1.0
    assert rec["down_s"] + rec["start_s"] + rec["first_step_s"] == pytest.approx(
        rec["restart_seconds"]
    )
    assert clock.tick(6) is None  # journaled once
    assert [e["step"] for e in read_events(tmp_path / "j.jsonl")] == [5]


def test_in_process_restart_has_no_downtime(tmp_path):
    """The previous run died after this process started (a supervisor restarting training
    in-process): down_s is 0, never negative."""
    clock = RestartClock(Journal(tmp_path / "j.jsonl"), signs_of_life=[time.time()])
    clock.restoring()
    clock.restored(3)
    rec = clock.tick(4)
    assert rec is not None and rec["down_s"] == 0.0 and rec["restore_s"] is not None
    assert json.loads(json.dumps(rec))["restored_step"] == 3


def test_process_start_time_is_before_the_engine_import():
    t, source = process_start_time()
    assert t <= IMPORTED_T <= time.time()
    if sys.platform == "linux":
        assert source == "proc" and os.path.exists("/proc/self/stat")


def test_a_standby_takeover_times_the_wait_not_the_process_age(tmp_path):
    """A standby started long before the kill: down is the wait (kill -> woke), start is the
    opening (woke -> restore); the standby's own start-up is not part of the restart."""
    clock = RestartClock(Journal(tmp_path / "j.jsonl"), signs_of_life=[100.0])
    clock.process_t = 10.0  # started 90 s before the kill
    clock.takeover(100.3)
    clock._restore_t0, clock._restore_t1, clock._restored_step = 100.35, 100.8, 7
    parts = clock.parts(100.0, 101.2)
    assert parts["takeover"] is True
    assert parts["down_s"] == parts["wait_s"] == pytest.approx(0.3)
    assert parts["start_s"] == parts["open_s"] == pytest.approx(0.05)
    assert parts["restore_s"] == pytest.approx(0.45) and parts["first_step_s"] == pytest.approx(0.4)
    assert parts["restart_seconds"] == pytest.approx(1.2)
    cold = RestartClock(Journal(tmp_path / "k.jsonl"), signs_of_life=[100.0])
    assert "takeover" not in cold.parts(100.0, 101.0)
