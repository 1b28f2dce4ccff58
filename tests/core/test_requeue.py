"""A requeued job that lands back on the node where an earlier attempt died (issue 27).

Attempt 1 on node A saves steps into its memory tier (``Promotion(every=k)``: some never reach
disk) and is SIGKILLed. Attempt 2 on node B (another memory-tier directory, same disk root)
restores an older step from disk and saves the same step numbers again, durable on disk.
Attempt 3 lands back on node A: restore() must return attempt 2's step, bit for bit, never
attempt 1's abandoned copy that A's memory tier still holds; that copy is journaled and removed
from A. Every attempt is a real process killed with SIGKILL.
"""

from __future__ import annotations

import contextlib
import io
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

import flashckpt
from flashckpt.cli import main as cli_main
from flashckpt.journal import read_events
from flashckpt.store.files.backend import LocalBackend
from flashckpt.store.store import CheckpointStore

WORKER = Path(__file__).parent.parent / "scripts" / "requeue_worker.py"
N = 64 * 1024


def attempt(
    root: Path, mem: Path, *, every: int, base: float, steps: list[int], restore: bool = True
) -> str:
    """Run one attempt until it says ready, SIGKILL it; returns what it printed."""
    args = [str(root), str(mem), str(every), str(base), ",".join(map(str, steps))]
    proc = subprocess.Popen(
        [sys.executable, str(WORKER), *args, *([] if restore else ["norestore"])],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout or []), daemon=True)
    reader.start()
    deadline = time.monotonic() + 180
    while "ready\n" not in list(lines):
        if proc.poll() is not None:
            raise AssertionError(proc.stderr.read() if proc.stderr else "worker died")
        assert time.monotonic() < deadline, "worker made no progress"
        time.sleep(0.01)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=60)
    reader.join(timeout=60)
    return "".join(lines)


def steps_in(path: Path) -> list[int]:
    return CheckpointStore(LocalBackend(path)).steps()


def restore_on(root: Path, mem: Path) -> tuple[int | None, dict]:
    with flashckpt.Checkpointer(
        root, memory_tier=mem, keep_memory=10, keep_memory_after_close=True
    ) as ckpt:
        state = {"w": torch.zeros(N), "meta": None}
        return ckpt.restore(state), state


def expected(step: int, base: float) -> torch.Tensor:
    return torch.arange(N, dtype=torch.float32) + step + base


def ls(root: Path, mem: Path) -> dict[str, str]:
    """``flashckpt ls``: {step: its row}."""
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert cli_main(["ls", str(root), "--memory-tier", str(mem)]) == 0
    rows = [line.split() for line in buf.getvalue().splitlines()]
    return {r[0]: " ".join(r) for r in rows if r and r[0].isdigit()}


def abandoned(root: Path) -> set[tuple[int, str]]:
    return {(e["step"], e["tier"]) for e in read_events(root) if e["event"] == "abandoned_copy"}


def test_requeue_onto_the_old_node_restores_the_later_run(tmp_path) -> None:
    root, node_a, node_b = tmp_path / "ckpt", tmp_path / "shm-a", tmp_path / "shm-b"
    attempt(root, node_a, every=3, base=0.0, steps=[1, 2, 3, 4, 5, 6])
    assert steps_in(root) == [1, 4]  # 2, 3, 5, 6 only in node A's memory tier
    assert steps_in(node_a) == [1, 2, 3, 4, 5, 6]
    out = attempt(root, node_b, every=1, base=100.0, steps=[5, 6])
    assert "restored 4" in out
    assert steps_in(root) == [1, 4, 5, 6]
    listing = ls(root, node_a)
    assert "memory (abandoned),local" in listing["6"] and "abandoned" not in listing["4"]
    reader = {"w": torch.zeros(N), "meta": None}  # a read-only reader (an eval process)
    assert flashckpt.restore(root, reader, memory_tier=str(node_a)) == 6
    assert torch.equal(reader["w"], expected(6, 100.0))
    assert steps_in(node_a) == [1, 2, 3, 4, 5, 6]  # a reader removes nothing
    step, state = restore_on(root, node_a)
    assert step == 6
    assert torch.equal(state["w"], expected(6, 100.0))  # attempt 2's bytes, bit for bit
    assert state["meta"] == {"step": 6, "base": 100.0}
    assert abandoned(root) == {(5, "memory"), (6, "memory")}
    assert steps_in(node_a) == [1, 2, 3, 4]  # attempt 1's copies of 5 and 6 are gone


def test_a_later_run_that_saved_only_a_lower_step_never_restores_the_higher(tmp_path) -> None:
    root, node_a, node_b = tmp_path / "ckpt", tmp_path / "shm-a", tmp_path / "shm-b"
    attempt(root, node_a, every=3, base=0.0, steps=[1, 2, 3, 4, 5, 6])
    out = attempt(root, node_b, every=1, base=100.0, steps=[5])  # restores 4, saves 5 only
    assert "restored 4" in out
    step, state = restore_on(root, node_a)
    assert step == 5  # not attempt 1's 6, which A's memory tier still held
    assert torch.equal(state["w"], expected(5, 100.0))
    assert abandoned(root) == {(5, "memory"), (6, "memory")}
    assert steps_in(node_a) == [1, 2, 3, 4]


def test_a_fresh_start_on_another_node_abandons_the_crashed_run(tmp_path) -> None:
    root, node_a, node_b = tmp_path / "ckpt", tmp_path / "shm-a", tmp_path / "shm-b"
    attempt(root, node_a, every=10, base=0.0, steps=[1, 2, 3, 4, 5, 6])
    disk = CheckpointStore(LocalBackend(root))
    for s in disk.steps():  # the disk copies are lost: attempt 2's restore finds nothing
        disk.delete_step(s)
    out = attempt(root, node_b, every=1, base=100.0, steps=[1, 2, 3])
    assert "restored None" in out
    step, state = restore_on(root, node_a)
    assert step == 3 and torch.equal(state["w"], expected(3, 100.0))
    assert abandoned(root) == {(s, "memory") for s in range(1, 7)}
    assert steps_in(node_a) == []


def test_a_run_that_never_restored_abandons_nothing(tmp_path) -> None:
    """Unknown branch point (restore never called): older checkpoints never vanish."""
    root, node_a, node_b = tmp_path / "ckpt", tmp_path / "shm-a", tmp_path / "shm-b"
    attempt(root, node_a, every=3, base=0.0, steps=[1, 2, 3])
    attempt(root, node_b, every=1, base=100.0, steps=[7], restore=False)
    from flashckpt.store.format.lineage import Lineage

    manifest = CheckpointStore(LocalBackend(root)).load_manifest(7)
    assert manifest.lineage == Lineage(generation=2, parent_generation=1, parent_step=None)
    step, state = restore_on(root, node_a)
    assert step == 7 and torch.equal(state["w"], expected(7, 100.0))
    assert abandoned(root) == set()
    assert steps_in(node_a) == [1, 2, 3]


def test_tiers_that_disagree_on_a_step_are_decided_by_lineage_not_tier_order(tmp_path) -> None:
    """Attempt 2 never restored (both copies of step 2 stay live): the newer generation's copy
    on disk is the checkpoint, not the faster memory tier's older one."""
    root, node_a, node_b = tmp_path / "ckpt", tmp_path / "shm-a", tmp_path / "shm-b"
    attempt(root, node_a, every=3, base=0.0, steps=[1, 2])
    assert steps_in(root) == [1] and steps_in(node_a) == [1, 2]
    attempt(root, node_b, every=1, base=100.0, steps=[2], restore=False)
    step, state = restore_on(root, node_a)
    assert step == 2 and torch.equal(state["w"], expected(2, 100.0))
    events = [e for e in read_events(root) if e["event"] == "abandoned_copy"]
    assert [(e["step"], e["tier"], e["verdict"]) for e in events] == [(2, "memory", "superseded")]
    assert steps_in(node_a) == [1]
