"""Bad input gets a clear error; nothing is lost; older checkpoints are never damaged."""

from __future__ import annotations

import errno
import io
import subprocess
import sys
import textwrap

import pytest
import torch

import flashckpt
from flashckpt.store.files.backend import LocalBackend


def _files(root):
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


@pytest.mark.parametrize(
    "bad, key",
    [
        (lambda: lambda x: x, "cfg/fn"),
        (lambda: io.StringIO("x"), "cfg/fn"),
        (lambda: object(), "cfg/fn"),
        (lambda: torch.ones(2).to_sparse(), "cfg/fn"),
    ],
)
def test_unsupported_objects_refused_before_writing(tmp_path, make_state, bad, key):
    state = make_state()
    state["cfg"] = {"lr": 0.1, "fn": bad()}
    with flashckpt.Checkpointer(tmp_path) as ckpt:
        before = _files(tmp_path)
        with pytest.raises(flashckpt.UnsupportedStateError, match=key):
            ckpt.save(1, state)
        assert ckpt.steps() == []
        assert not [f for f in _files(tmp_path) if f not in before and f.startswith("chunks")]


def test_shape_mismatch_lists_keys_and_strict_false_loads_rest(tmp_path, make_state):
    state = make_state(width=32)
    with flashckpt.Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, {"model": state["model"]})
    other = make_state(width=16, seed=4)["model"]
    before = {k: v.clone() for k, v in other.state_dict().items()}
    with flashckpt.Checkpointer(tmp_path) as ckpt:
        with pytest.raises(flashckpt.StateMismatchError) as info:
            ckpt.restore({"model": other})
        assert "model/fc1.weight" in info.value.keys
        assert "strict=False" in str(info.value)
        # nothing was loaded by the failed attempt
        for k, v in other.state_dict().items():
            assert torch.equal(v, before[k])
        assert ckpt.restore({"model": other}, strict=False) == 1
    # fc2.bias has the same shape (4) in both models: loaded; fc1.weight differs: untouched
    assert torch.equal(other.fc2.bias, state["model"].fc2.bias)
    assert torch.equal(other.fc1.weight, before["fc1.weight"])


def test_missing_state_entry_is_a_mismatch(tmp_path, make_state):
    state = make_state()
    with flashckpt.Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, {"model": state["model"]})
        with pytest.raises(flashckpt.StateMismatchError, match="optim"):
            ckpt.restore({"model": state["model"], "optim": state["optim"]})


class FullDisk(LocalBackend):
    """Raises ENOSPC on the Nth chunk write."""

    def __init__(self, root, fail_at: int) -> None:
        super().__init__(root)
        self.fail_at = fail_at
        self.puts = 0

    def put(self, path, parts):
        if path.startswith("chunks/"):
            self.puts += 1
            if self.puts >= self.fail_at:
                raise flashckpt.StorageError(
                    f"could not write {path}: {errno.errorcode[errno.ENOSPC]}; the device is full"
                )
        return super().put(path, parts)


@pytest.mark.parametrize("async_save", [False, True])
def test_disk_full_cleans_up_and_keeps_older(tmp_path, make_state, async_save):
    state = make_state(width=256)
    with flashckpt.Checkpointer(tmp_path, async_save=async_save, chunk_size="64KiB") as ckpt:
        ckpt.save(1, state).wait()
        good = _files(tmp_path)
        w1 = state["model"].fc1.weight.detach().clone()
        with torch.no_grad():
            for p in state["model"].parameters():
                p.add_(1)
        ckpt.store.backend = FullDisk(tmp_path, fail_at=3)
        with pytest.raises(flashckpt.StorageError, match="full"):
            ckpt.save(2, state).wait()
        ckpt.store.backend = LocalBackend(tmp_path)
        assert ckpt.steps() == [1]
    chunks = [f for f in _files(tmp_path) if f.startswith("chunks")]
    assert chunks == [f for f in good if f.startswith("chunks")]
    target = make_state(width=256, trained=0, seed=8)
    with flashckpt.Checkpointer(tmp_path) as ckpt:
        assert ckpt.restore(target) == 1
    assert torch.equal(target["model"].fc1.weight, w1)


def test_second_writer_is_refused(tmp_path):
    ckpt = flashckpt.Checkpointer(tmp_path)
    code = textwrap.dedent(
        f"""
        import flashckpt
        try:
            flashckpt.Checkpointer({str(tmp_path)!r})
        except flashckpt.LockedError as e:
            print("LOCKED", e)
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "LOCKED" in out.stdout and "another process" in out.stdout, out.stderr
    ckpt.close()
    again = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120
    )
    assert "LOCKED" not in again.stdout, again.stdout


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"compression": "lz4"}, "compression"),
        ({"host_memory_budget": "lots"}, "host_memory_budget"),
        ({"on_busy": "panic"}, "on_busy"),
        ({"keep": "3"}, "keep"),
        ({"async_save": "yes"}, "async_save"),
    ],
)
def test_bad_options(tmp_path, kwargs, match):
    with pytest.raises(flashckpt.ConfigError, match=match):
        flashckpt.Checkpointer(tmp_path, **kwargs)


def test_bad_state_and_step(tmp_path, make_state):
    with flashckpt.Checkpointer(tmp_path) as ckpt:
        with pytest.raises(flashckpt.ConfigError, match="step"):
            ckpt.save(-1, make_state())
        with pytest.raises(flashckpt.ConfigError, match="dict"):
            ckpt.save(1, [1, 2])  # type: ignore[arg-type]
        with pytest.raises(flashckpt.ConfigError, match="should_save"):
            ckpt.should_save(1)


def test_second_writer_in_same_process_is_refused(tmp_path):
    with flashckpt.Checkpointer(tmp_path):
        with pytest.raises(flashckpt.LockedError, match="this process"):
            flashckpt.Checkpointer(tmp_path)
    flashckpt.Checkpointer(tmp_path).close()  # released on close


def test_lock_not_inherited_by_forked_children(tmp_path):
    """A DataLoader worker (a fork) of a killed trainer must not keep the root locked."""
    import os
    import signal
    import time

    code = textwrap.dedent(
        f"""
        import os, sys, time, flashckpt
        ck = flashckpt.Checkpointer({str(tmp_path)!r})
        if os.fork() == 0:
            time.sleep(30)  # the child lingers, like a worker of a dead trainer
            os._exit(0)
        print("ready", flush=True)
        time.sleep(30)
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    time.sleep(0.1)
    try:
        flashckpt.Checkpointer(tmp_path).close()  # would raise LockedError with flock()
    finally:
        subprocess.run(["pkill", "-f", str(tmp_path)], check=False)


def test_unexpected_keys_are_a_mismatch(tmp_path, make_state):
    """A checkpoint with parameters the model lacks: named up front, skipped with strict=False."""
    big = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    with flashckpt.Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, {"model": big})
    small = torch.nn.Sequential(torch.nn.Linear(4, 4))
    with flashckpt.Checkpointer(tmp_path) as ckpt:
        with pytest.raises(flashckpt.StateMismatchError, match=r"1\.weight \(in the checkpoint"):
            ckpt.restore({"model": small})
        assert ckpt.restore({"model": small}, strict=False) == 1
    assert torch.equal(small[0].weight, big[0].weight)
