"""Save and restore through the public API, over the knobs."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

import flashckpt


@pytest.mark.parametrize("async_save", [False, True])
@pytest.mark.parametrize("incremental", [False, True])
@pytest.mark.parametrize("compression", [None, "zstd"])
def test_roundtrip_bitwise(tmp_path, make_state, state_equal, async_save, incremental, compression):
    state = make_state(trained=3)
    state["extra"] = {
        "epoch": 3,
        "name": "run-1",
        "pair": (1, 2.5),
        "nan": float("nan"),
        "ids": {7: "seven", (1, 2): None},
        "arr": np.arange(6, dtype=np.int32).reshape(2, 3),
        "bf16": torch.randn(5).to(torch.bfloat16),
    }
    expected = copy.deepcopy(state)
    with flashckpt.Checkpointer(
        tmp_path, async_save=async_save, incremental=incremental, compression=compression
    ) as ckpt:
        handle = ckpt.save(10, state)
        stats = handle.durable.result(timeout=60)
        assert handle.staged.done()
        assert stats.total_bytes > 0
        assert ckpt.steps() == [10]

    fresh = make_state(trained=0, seed=99)
    fresh["extra"] = None
    with flashckpt.Checkpointer(tmp_path) as ckpt:
        assert ckpt.restore(fresh) == 10
    state_equal(
        {k: expected[k] for k in ("model", "optim", "sched")},
        {k: fresh[k] for k in ("model", "optim", "sched")},
    )
    extra = fresh["extra"]
    assert extra["epoch"] == 3 and extra["name"] == "run-1" and extra["pair"] == (1, 2.5)
    assert np.isnan(extra["nan"])
    assert extra["ids"] == {7: "seven", (1, 2): None}
    assert np.array_equal(extra["arr"], expected["extra"]["arr"])
    assert extra["arr"].dtype == np.int32
    assert torch.equal(extra["bf16"], expected["extra"]["bf16"])


def test_restore_without_checkpoint_returns_none(tmp_path, make_state):
    with flashckpt.Checkpointer(tmp_path) as ckpt:
        assert ckpt.restore(make_state()) is None
        assert ckpt.steps() == []
        with pytest.raises(flashckpt.NoCheckpointError):
            ckpt.restore(make_state(), step=3)


def test_restores_newest_and_explicit_step(tmp_path, make_state):
    a = make_state(trained=1)
    with flashckpt.Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, a)
        w1 = a["model"].fc1.weight.detach().clone()
        with torch.no_grad():
            a["model"].fc1.weight.add_(1.0)
        ckpt.save(2, a)
        w2 = a["model"].fc1.weight.detach().clone()
    b = make_state(trained=0, seed=5)
    with flashckpt.Checkpointer(tmp_path) as ckpt:
        assert ckpt.steps() == [1, 2]
        assert ckpt.restore(b) == 2
        assert torch.equal(b["model"].fc1.weight, w2)
        assert ckpt.restore(b, step=1) == 1
        assert torch.equal(b["model"].fc1.weight, w1)


def test_inplace_tensor_and_numpy_targets(tmp_path):
    t = torch.arange(10, dtype=torch.float64)
    arr = np.linspace(0, 1, 7)
    with flashckpt.Checkpointer(tmp_path) as ckpt:
        ckpt.save(0, {"t": t, "a": arr})
    t2 = torch.zeros(10, dtype=torch.float64)
    a2 = np.zeros(7)
    ptr = t2.data_ptr()
    with flashckpt.Checkpointer(tmp_path) as ckpt:
        ckpt.restore({"t": t2, "a": a2})
    assert t2.data_ptr() == ptr and torch.equal(t, t2)
    assert np.array_equal(arr, a2)


def test_context_manager_and_closed(tmp_path, make_state):
    ckpt = flashckpt.Checkpointer(tmp_path)
    ckpt.close()
    with pytest.raises(flashckpt.FlashCkptError, match="closed"):
        ckpt.save(1, make_state())


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_roundtrip_from_the_memory_tier_bitwise(tmp_path, make_state, state_equal, compression):
    """Restore reads the memory tier's chunks by mapping them when it is a tmpfs
    (engine/restore/reader.py); the state comes back bit for bit either way."""
    import os
    import shutil
    from pathlib import Path

    shm = Path("/dev/shm")
    mem = (shm if shm.is_dir() else tmp_path) / f"flashckpt-test-rt-{os.getpid()}-{compression}"
    state = make_state(trained=2)
    expected = copy.deepcopy(state)
    try:
        with flashckpt.Checkpointer(
            tmp_path / "root",
            memory_tier=mem,
            compression=compression,
            chunk_size="64KiB",
            keep_memory_after_close=True,  # else a clean close empties it (disk holds all)
        ) as ckpt:
            ckpt.save(4, state)
        fresh = make_state(trained=0, seed=3)
        with flashckpt.Checkpointer(tmp_path / "root", memory_tier=mem) as ckpt:
            assert ckpt.restore(fresh) == 4
        state_equal(expected, fresh)
    finally:
        shutil.rmtree(mem, ignore_errors=True)
