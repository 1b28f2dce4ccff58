"""``Promotion(every=k)``: only every k-th memory-tier step is promoted to the slower tiers.

The others live in the memory tier alone (they survive the process, not the node); the newest
step of a run always reaches the slower tiers at ``close()``; a process killed with SIGKILL
leaves its newest step in the memory tier, and the next run restores it from there.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import flashckpt
from flashckpt.errors import ConfigError
from flashckpt.policy import KeepLast
from flashckpt.store.files.backend import LocalBackend
from flashckpt.store.store import CheckpointStore


def _state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(256, 256, generator=g), "b": torch.randn(256, generator=g)}


def _disk_steps(root: Path) -> list[int]:
    return CheckpointStore(LocalBackend(root)).steps()


def _ckpt(tmp_path: Path, every: int, **kw: object) -> flashckpt.Checkpointer:
    return flashckpt.Checkpointer(
        tmp_path / "root",
        memory_tier=tmp_path / "mem",
        promotion=flashckpt.Promotion(every=every),
        **kw,  # type: ignore[arg-type]
    )


def test_every_third_step_is_promoted_and_close_promotes_the_newest(tmp_path: Path) -> None:
    ck = _ckpt(tmp_path, 3, keep_memory=KeepLast(8))
    for step in range(1, 9):
        ck.save(step, {"s": _state(step)}).wait()
        ck.wait_promoted()
    assert _disk_steps(tmp_path / "root") == [1, 4, 7]
    assert _disk_steps(tmp_path / "mem") == list(range(1, 9))
    ck.close()
    assert _disk_steps(tmp_path / "root") == [1, 4, 7, 8]
    out = {"s": _state(0)}
    with flashckpt.Checkpointer(tmp_path / "root") as disk_only:
        assert disk_only.restore(out) == 8
    assert all(torch.equal(out["s"][k], _state(8)[k]) for k in out["s"])


def test_deferred_steps_do_not_stop_close_from_emptying_the_memory_tier(tmp_path: Path) -> None:
    ck = _ckpt(tmp_path, 4, keep_memory=KeepLast(3))
    for step in range(1, 7):
        ck.save(step, {"s": _state(step)}).wait()
    ck.close()  # 1 and 5 promoted during the run, 6 at close; 4 and 5 older than 6
    assert _disk_steps(tmp_path / "root") == [1, 5, 6]
    assert _disk_steps(tmp_path / "mem") == []


def test_a_killed_run_restores_its_unpromoted_newest_step_from_memory(tmp_path: Path) -> None:
    script = textwrap.dedent(
        f"""
        import os, signal, torch, flashckpt
        ck = flashckpt.Checkpointer(
            {str(tmp_path / "root")!r},
            memory_tier={str(tmp_path / "mem")!r},
            promotion=flashckpt.Promotion(every=5),
        )
        for step in (1, 2, 3):
            g = torch.Generator().manual_seed(step)
            s = {{"w": torch.randn(256, 256, generator=g), "b": torch.randn(256, generator=g)}}
            ck.save(step, {{"s": s}}).wait()
            ck.wait_promoted()
        os.kill(os.getpid(), signal.SIGKILL)
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert proc.returncode == -9, proc.stderr
    assert _disk_steps(tmp_path / "root") == [1]
    out = {"s": _state(0)}
    ck = _ckpt(tmp_path, 5)
    assert ck.restore(out) == 3
    assert all(torch.equal(out["s"][k], _state(3)[k]) for k in out["s"])
    ck.close()  # the restored step is this process's first: promoted
    assert _disk_steps(tmp_path / "root") == [1, 3]


def test_sigterm_promotes_the_emergency_step_the_cadence_would_skip(
    tmp_path: Path, shm_dir: Path
) -> None:
    """SIGTERM right after the save of step 10 (saves every 5 steps; only every 100th is due):
    step 5 (the first) is promoted during the run, 10 is not, and the emergency save at the
    next step reaches the disk at close, within the grace period; a restore without the memory tier
    loads it."""
    from test_processes import _events, _run, _train_until_saved

    root = tmp_path / "ck"
    env = {**os.environ, "WORKER_PROMOTE_EVERY": "100"}
    proc, lines = _train_until_saved(["train", str(root), str(shm_dir), "-", "emergency"], env)
    assert proc.returncode == 0, lines[-1]
    done = _events(root, "preempt_done")
    assert len(done) == 1 and done[0]["grace_left_s"] > 0
    final = done[0]["step"]
    assert final is not None and final > 10  # the emergency save at the next step
    assert sorted(e["step"] for e in _events(root, "promoted")) == [5, final]
    assert _disk_steps(root) == [5, final]
    sums = dict(ln.split()[1:3] for ln in lines if ln.startswith("step "))
    restored = _run("restore", str(root), str(tmp_path / "no-memory-tier"))
    assert restored.returncode == 0, restored.stderr
    got = json.loads(restored.stdout)
    assert got["step"] == final and got["checksum"] == sums[str(final)]


@pytest.mark.parametrize("bad", [0, -1, True, 1.5, "2"])
def test_every_must_be_a_positive_int(bad: object) -> None:
    with pytest.raises(ConfigError, match="every"):
        flashckpt.Promotion(every=bad)  # type: ignore[arg-type]


def test_every_with_peer_replication_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="replicas"):
        _ckpt(tmp_path, 2, replicas=1)
    assert not (tmp_path / "root").exists()
