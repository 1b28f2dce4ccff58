"""N steps straight == k steps, save, SIGKILL, restore in a new process, N-k more: bitwise."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

WORKER = Path(__file__).parent.parent / "scripts" / "resume_worker.py"


def _run(*args: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(WORKER), *map(str, args)], capture_output=True, text=True, timeout=300
    )


def test_exact_resume_after_kill(tmp_path):
    total, k = 30, 13  # k is mid-epoch (the dataset has ~26 batches per epoch)
    straight = _run(tmp_path / "a", tmp_path / "straight.json", "straight", total)
    assert straight.returncode == 0, straight.stderr
    crashed = _run(tmp_path / "b", tmp_path / "part1.json", "crash", total, k)
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr
    resumed = _run(tmp_path / "b", tmp_path / "part2.json", "resume", total)
    assert resumed.returncode == 0, resumed.stderr

    ref = json.loads((tmp_path / "straight.json").read_text())
    part1 = json.loads((tmp_path / "part1.json").read_text())
    part2 = json.loads((tmp_path / "part2.json").read_text())
    assert part2["start"] == k
    assert part1["losses"] + part2["losses"] == ref["losses"]  # exact float equality
    assert part2["params"] == ref["params"]
    # and the run is not trivially deterministic without the checkpoint: a fresh start differs
    assert ref["losses"][k] != ref["losses"][0]
