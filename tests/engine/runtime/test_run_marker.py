"""A crashed run is detected at the next start, and the steps it lost are journaled."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap

import torch

import flashckpt
from flashckpt.journal import read_events


def test_crash_detected_and_steps_lost(tmp_path):
    code = textwrap.dedent(
        f"""
        import os, signal, torch, flashckpt
        ck = flashckpt.Checkpointer({str(tmp_path)!r}, save_policy=5)
        w = torch.zeros(4)
        for step in range(1, 13):
            w += 1
            if ck.should_save(step):
                ck.save(step, {{"w": w}})
        os.kill(os.getpid(), signal.SIGKILL)
        """
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=120)
    assert res.returncode == -signal.SIGKILL, res.stderr
    out = {"w": torch.zeros(4)}
    with flashckpt.Checkpointer(tmp_path) as ck:
        assert ck.restore(out) == 10
    assert torch.equal(out["w"], torch.full((4,), 10.0))
    events = read_events(tmp_path)
    crash = [e for e in events if e["event"] == "crash_detected"]
    assert len(crash) == 1 and crash[0]["last_step"] == 10 and crash[0]["last_trained_step"] == 12
    lost = [e for e in events if e["event"] == "steps_lost"]
    assert lost == [lost[0]] and (lost[0]["from_step"], lost[0]["to_step"]) == (10, 12)
    assert lost[0]["steps"] == 2


def test_clean_close_is_not_a_crash(tmp_path):
    with flashckpt.Checkpointer(tmp_path, save_policy=2) as ck:
        for step in range(1, 5):
            if ck.should_save(step):
                ck.save(step, {"w": torch.ones(2) * step})
    with flashckpt.Checkpointer(tmp_path) as ck:
        ck.restore({"w": torch.zeros(2)})
    events = read_events(tmp_path)
    assert not [e for e in events if e["event"] in ("crash_detected", "steps_lost")]
    starts = [e for e in events if e["event"] == "run_start"]
    assert [e["clean_previous"] for e in starts] == [True, True]
