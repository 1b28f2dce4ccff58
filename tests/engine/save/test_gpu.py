"""CUDA saves: bitwise restore, device fingerprints that skip unchanged chunks (and never miss a
flipped bit), pinned staging. Marked ``gpu``; skipped cleanly without CUDA."""

from __future__ import annotations

import copy

import pytest
import torch

import flashckpt
from flashckpt.engine.save.staging import StagingPool

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
CHUNK = "256KiB"  # several chunks per weight, so a flipped bit dirties exactly one


def _train(model, opt, steps, seed=0):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(8, 256, generator=g).cuda()
        loss = model(x).square().mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()


def _state(seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(256, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 256)
    ).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    _train(model, opt, 2, seed=seed)
    return {"model": model, "optim": opt}


def _snapshot(state):
    return {
        "model": {k: v.detach().clone() for k, v in state["model"].state_dict().items()},
        "optim": copy.deepcopy(state["optim"].state_dict()),
    }


def _assert_bitwise(state, snap):
    for k, v in state["model"].state_dict().items():
        assert v.is_cuda
        assert torch.equal(v.view(torch.uint8), snap["model"][k].view(torch.uint8)), k
    got = state["optim"].state_dict()["state"]
    for pid, st in snap["optim"]["state"].items():
        for name, v in st.items():
            a, b = got[pid][name], v
            assert a.device == b.device, (pid, name)
            assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def _restore(root, step):
    fresh = _state(seed=1)
    with flashckpt.Checkpointer(root) as ck:
        assert ck.restore(fresh, step=step) == step
    return fresh


@pytest.fixture
def acquires(monkeypatch):
    """Counts staging slots taken: each is one chunk copied device -> host."""
    count = {"n": 0}
    real = StagingPool.try_acquire  # every staged chunk asks for its range here first

    def counting(self, nbytes):
        count["n"] += 1
        return real(self, nbytes)

    monkeypatch.setattr(StagingPool, "try_acquire", counting)
    return count


def test_async_save_of_cuda_state_restores_bitwise(tmp_path):
    state = _state()
    with flashckpt.Checkpointer(tmp_path, async_save=True, chunk_size=CHUNK) as ck:
        handle = ck.save(1, state)
        snap = _snapshot(state)  # nothing has changed the state since save()
        _train(state["model"], state["optim"], 1, seed=5)  # hook: waits for staging
        handle.wait()
    assert not torch.equal(state["model"][0].weight, snap["model"]["0.weight"])
    _assert_bitwise(_restore(tmp_path, 1), snap)


def test_unchanged_cuda_state_is_not_copied_to_host_again(tmp_path, acquires):
    state = _state()
    with flashckpt.Checkpointer(
        tmp_path, async_save=True, incremental=True, chunk_size=CHUNK
    ) as ck:
        first = ck.save(1, state).wait()
        copied_first = acquires["n"]
        second = ck.save(2, state).wait()
    assert copied_first > 0 and first.new_bytes > 0
    assert acquires["n"] == copied_first, "unchanged chunks were copied to the host"
    assert second.new_bytes == 0 and second.chunks_new == 0
    assert second.reused_bytes == second.total_bytes == first.total_bytes


@pytest.mark.parametrize(("index", "bit"), [(0, 0), (12345, 7), (-1, 31)])
def test_single_flipped_bit_in_cuda_tensor_is_detected(tmp_path, acquires, index, bit):
    state = _state()
    with flashckpt.Checkpointer(
        tmp_path, async_save=True, incremental=True, chunk_size=CHUNK
    ) as ck:
        ck.save(1, state).wait()
        before = acquires["n"]
        words = state["model"][0].weight.data.view(-1).view(torch.int32)
        words[index] ^= 1 << bit if bit < 31 else -(1 << 31)
        snap = _snapshot(state)
        second = ck.save(2, state).wait()
    assert acquires["n"] - before == 1, "exactly the chunk holding the bit is copied"
    assert second.chunks_new == 1 and 0 < second.new_bytes <= 256 << 10
    _assert_bitwise(_restore(tmp_path, 2), snap)


def test_staging_pool_is_pinned_for_cuda_state(tmp_path):
    state = _state()
    with flashckpt.Checkpointer(tmp_path, async_save=True) as ck:
        ck.save(1, state).wait()
        pool = ck._pool
        assert pool.pinned
        assert pool.view(0, 16).is_pinned()
        assert pool.capacity_bytes >= ck.save(2, state).wait().total_bytes
