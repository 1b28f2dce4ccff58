"""Real processes: SIGKILL before promotion, SIGTERM mid-save (preemption)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from flashckpt.journal import read_events

WORKER = str(Path(__file__).with_name("worker.py"))


def _run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, WORKER, *args], capture_output=True, text=True, timeout=120, env=env
    )


def _steps(d: Path) -> list[int]:
    return sorted(int(p.name.split(".")[0]) for p in (d / "steps").glob("*.json"))


def _events(root: Path, name: str) -> list[dict[str, Any]]:
    return [e for e in read_events(root) if e["event"] == name]


def test_memory_only_checkpoint_after_sigkill_is_restored_then_promoted(
    tmp_path: Path, shm_dir: Path
) -> None:
    root = tmp_path / "ck"
    killed = _run("kill", str(root), str(shm_dir))
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    saved = json.loads(killed.stdout.splitlines()[0])
    assert _steps(shm_dir) == [7]
    assert not (root / "steps").exists() or _steps(root) == []  # never promoted
    restored = _run("restore", str(root), str(shm_dir))
    assert restored.returncode == 0, restored.stderr
    assert json.loads(restored.stdout) == saved
    assert _events(root, "crash_detected")
    assert _events(root, "restore")[-1]["tier"] == "memory"
    assert _steps(root) == [7]  # promoted to local by the restarted process
    assert [(e["step"], e["dst"]) for e in _events(root, "promoted")] == [(7, "local")]


def _train_until_saved(
    args: list[str], env: dict[str, str]
) -> tuple[subprocess.Popen[str], list[str]]:
    proc = subprocess.Popen(
        [sys.executable, WORKER, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    lines: list[str] = []
    assert proc.stdout is not None
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line.strip())
        if line.startswith("saved 10"):  # save() returned; persisting is still in flight
            proc.send_signal(signal.SIGTERM)
            break
    out, err = proc.communicate(timeout=90)
    return proc, lines + out.splitlines() + [err]


# emergency=False (15 s) in make test-slow: the emergency save path covers the same promotions
@pytest.mark.parametrize("emergency", [pytest.param(False, marks=pytest.mark.slow), True])
def test_sigterm_mid_save_finishes_save_and_promotions_then_exits_cleanly(
    tmp_path: Path, shm_dir: Path, s3_env: str, s3_bucket: str, emergency: bool
) -> None:
    root, url = tmp_path / "ck", f"s3://{s3_bucket}/run"
    args = ["train", str(root), str(shm_dir), url] + (["emergency"] if emergency else [])
    proc, lines = _train_until_saved(args, dict(os.environ))
    assert proc.returncode == 0, lines[-1]
    assert "finished" not in lines  # it left the loop because of the signal
    pre = _events(root, "preempted")
    assert len(pre) == 1 and pre[0]["signal"] == signal.SIGTERM
    durable = {e["step"]: e for e in _events(root, "durable")}
    assert 10 in durable and durable[10]["t"] > pre[0]["t"]  # the in-flight save completed
    done = _events(root, "preempt_done")
    assert len(done) == 1 and done[0]["grace_left_s"] > 0
    final = done[0]["step"] if emergency else 10
    if emergency:
        assert final is not None and final > 10  # the emergency save at the next step
    else:
        assert done[0]["step"] is None and max(durable) == 10
    promoted = {(e["step"], e["dst"]) for e in _events(root, "promoted")}
    assert {(final, "local"), (final, "remote")} <= promoted
    sums = dict(ln.split()[1:3] for ln in lines if ln.startswith("step "))
    restored = _run("restore", str(root), str(tmp_path / "no-memory-tier"), url)
    assert restored.returncode == 0, restored.stderr
    got = json.loads(restored.stdout)
    assert got["step"] == final and got["checksum"] == sums[str(final)]
    assert _events(root, "restore")[-1]["tier"] == "local"
