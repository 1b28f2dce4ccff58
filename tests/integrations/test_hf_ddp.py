"""Hugging Face Trainer under torchrun (DDP, 2 gloo ranks): every rank saves its part through
flashckpt; a resumed run ends bitwise identical to one trained straight."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import accelerate  # noqa: F401  (the Trainer needs it; in the test extra)

from flashckpt.store.files.backend import LocalBackend
from flashckpt.store.store import CheckpointStore

WORKER = Path(__file__).with_name("hf_ddp_worker.py")


def torchrun(phase: str, tmp: Path) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    run = subprocess.run(
        [*cmd, str(WORKER), phase, str(tmp)], capture_output=True, text=True, timeout=240, env=env
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-5000:]


def test_ddp_trainer_resumes_bitwise_on_every_rank(tmp_path: Path) -> None:
    torchrun("first", tmp_path)
    store = CheckpointStore(LocalBackend(tmp_path / "b-ckpt"))
    assert store.steps() == [4]
    manifest = store.load_manifest(4)
    assert manifest.world_size == 2
    assert set(manifest.rank_trees) == {"0", "1"}, "each rank's TrainerState and RNG"
    torchrun("second", tmp_path)
    for rank in (0, 1):
        first = json.loads((tmp_path / f"first-rank{rank}.json").read_text())
        second = json.loads((tmp_path / f"second-rank{rank}.json").read_text())
        assert first["step"] == 4 and second["step"] == 10
        assert second["params"] == first["params"], f"rank {rank}: parameters differ"
        assert second["losses"] and second["losses"] == first["losses"]
