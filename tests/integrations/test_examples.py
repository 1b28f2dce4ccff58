"""The bundled examples, run as a user runs them (real subprocesses, torchrun for FSDP)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}


def run(*args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, timeout=timeout, env=ENV
    )
    return proc


def losses(root: Path, *args: str) -> dict[str, float]:
    proc = run(str(EXAMPLES / "exact_resume.py"), "--root", str(root), "--steps", "30", *args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])["losses"]
    assert isinstance(out, dict)
    return out


@pytest.mark.timeout(900)  # several example runs, one process each
def test_nanogpt_style_loop_resumes_bitwise_only_with_the_prefetched_batch(
    tmp_path: Path,
) -> None:
    straight = losses(tmp_path / "straight")
    assert sorted(map(int, straight)) == list(range(1, 31))
    first = losses(tmp_path / "resumed", "--stop-at", "10")
    assert sorted(map(int, first)) == list(range(1, 11))
    after = losses(tmp_path / "resumed")
    assert sorted(map(int, after)) == list(range(11, 31))
    assert {**first, **after} == straight  # bitwise: the floats are equal, not close


@pytest.mark.slow  # 14 s more of example runs
@pytest.mark.timeout(900)
def test_nanogpt_style_loop_without_the_prefetched_batch_resumes_with_other_losses(
    tmp_path: Path,
) -> None:
    """The README's warning, shown: without the batch drawn ahead of the save, every loss
    after the resume differs from the straight run's."""
    straight = losses(tmp_path / "straight")
    after = {k: v for k, v in straight.items() if int(k) > 10}
    losses(tmp_path / "no-batch", "--stop-at", "10", "--no-prefetch-in-state")
    lossy = losses(tmp_path / "no-batch", "--no-prefetch-in-state")
    assert sorted(lossy) == sorted(after)
    assert all(lossy[k] != straight[k] for k in lossy)


@pytest.mark.slow  # 34 s; make test checks the newest-step rule in test_lightning_latest.py
@pytest.mark.timeout(900)  # several example runs, one process each
def test_lightning_example_resumes_the_newest_step_not_the_last_name(tmp_path: Path) -> None:
    script = str(EXAMPLES / "lightning_train.py")
    d = tmp_path / "lit"
    first = run(script, "--dir", str(d), "--epochs", "4")
    assert first.returncode == 0, first.stderr[-3000:]
    assert "resuming from scratch" in first.stdout and "done at step 64" in first.stdout
    ckpts = d / "checkpoints"
    early = sorted(ckpts.glob("*.ckpt"))
    assert [p.name for p in early] == ["epoch=3-step=64.ckpt"]
    keep = tmp_path / early[0].name
    shutil.copy(early[0], keep)
    second = run(script, "--dir", str(d), "--epochs", "12")
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resuming from epoch=3-step=64.ckpt" in second.stdout
    assert "done at step 192" in second.stdout
    shutil.copy(keep, ckpts / keep.name)  # an older checkpoint kept (save_top_k=-1 keeps all)
    names = sorted(p.name for p in ckpts.glob("*.ckpt"))
    assert names == ["epoch=11-step=192.ckpt", "epoch=3-step=64.ckpt"]  # text order: 3 last
    third = run(script, "--dir", str(d), "--epochs", "13")
    assert third.returncode == 0, third.stderr[-3000:]
    assert "resuming from epoch=11-step=192.ckpt" in third.stdout
    assert "done at step 208" in third.stdout


@pytest.mark.timeout(900)  # several example runs, one process each
def test_hf_example_stops_resumes_and_exports_for_from_pretrained(tmp_path: Path) -> None:
    script = str(EXAMPLES / "hf_trainer.py")
    d = tmp_path / "hf"
    env_args = ("--dir", str(d), "--steps", "20")
    first = run(script, *env_args, "--stop-at", "10")
    assert first.returncode == 0, first.stderr[-3000:]
    assert "done at step 10" in first.stdout
    second = run(script, *env_args)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "done at step 20" in second.stdout
    out = tmp_path / "export"
    exported = run(
        "-m", "flashckpt.cli", "export", str(d / "flashckpt"), str(out), "--format", "hf"
    )
    assert exported.returncode == 0, exported.stderr[-3000:]
    assert json.loads((out / "config.json").read_text())["n_layer"] == 2


def torchrun(nproc: int, *args: str) -> subprocess.CompletedProcess[str]:
    cmd = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    return run(*cmd, str(EXAMPLES / "fsdp_torchrun.py"), *args, timeout=300)


def crash_resume_runs(tmp_path: Path, runs: int) -> None:
    """``runs`` times: train on 2 ranks to step 8 and crash, then resume to step 12, which
    must exit 0 (no abort at exit) with the same result every time."""
    checksums = set()
    for i in range(runs):
        root = tmp_path / f"ckpt{i}"
        crashed = torchrun(2, "--root", str(root), "--steps", "12", "--crash-at", "8")
        assert crashed.returncode != 0 and "crashing at step 8" in crashed.stdout
        resumed = torchrun(2, "--root", str(root), "--steps", "12")
        out = resumed.stdout + resumed.stderr
        assert resumed.returncode == 0, f"run {i}: {out[-3000:]}"
        assert "terminate called" not in out, f"run {i}: {out[-3000:]}"
        assert "resumed from step 5" in resumed.stdout
        checksums.add(resumed.stdout.split("checksum ", 1)[1].split()[0])
    assert len(checksums) == 1  # every resume lands on the same weights


@pytest.mark.dist
@pytest.mark.slow  # 58 s; make test runs its crash and resume in tests/distributed/test_example.py
@pytest.mark.timeout(900)  # 4 torchrun launches
def test_fsdp_example_crash_and_resume_exits_zero(tmp_path: Path) -> None:
    crash_resume_runs(tmp_path, 2)


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.timeout(3600)  # 20 torchrun launches
def test_fsdp_example_ten_consecutive_crash_resume_runs(tmp_path: Path) -> None:
    crash_resume_runs(tmp_path, 10)


def test_make_demo_installs_only_torch_and_the_package() -> None:
    root = EXAMPLES.parent
    demo = subprocess.run(
        ["make", "-n", "-B", "demo"], cwd=root, capture_output=True, text=True, timeout=60
    )
    assert demo.returncode == 0, demo.stderr
    installs = [line for line in demo.stdout.splitlines() if "pip install" in line]
    assert installs and not any("[test]" in line for line in installs), demo.stdout
    assert any(line.rstrip().endswith("-e . torch==2.13.0") for line in installs), demo.stdout
    test = subprocess.run(
        ["make", "-n", "-B", "test"], cwd=root, capture_output=True, text=True, timeout=60
    )
    assert "-e '.[test]'" in test.stdout  # make test still installs everything
