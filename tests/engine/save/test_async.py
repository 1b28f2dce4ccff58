"""Asynchronous saves: overlap with training, staging budget, errors that never vanish."""

from __future__ import annotations

import copy
import threading
import time

import pytest
import torch

import flashckpt
from flashckpt.store.files.backend import LocalBackend


def _train(state, steps, seed=1):
    g = torch.Generator().manual_seed(seed)
    model, opt = state["model"], state["optim"]
    for _ in range(steps):
        loss = model(torch.randn(16, model.fc1.in_features, generator=g)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()


class SlowBackend(LocalBackend):
    """Chunk writes wait on an event (or sleep), to hold a save in flight."""

    def __init__(self, root, *, gate: threading.Event | None = None, delay_s: float = 0.0):
        super().__init__(root)
        self.gate, self.delay_s = gate, delay_s

    def put(self, path, parts):
        if path.startswith("chunks/"):
            if self.gate is not None:
                self.gate.wait(30)
            time.sleep(self.delay_s)
        return super().put(path, parts)


class FailingBackend(LocalBackend):
    def put(self, path, parts):
        if path.startswith("chunks/"):
            raise OSError(5, "Input/output error (injected)")
        return super().put(path, parts)


def test_checkpoint_equals_state_at_save_call_while_training_continues(
    tmp_path, make_state, state_equal
):
    state = make_state(width=256)
    gate = threading.Event()
    with flashckpt.Checkpointer(tmp_path, async_save=True, chunk_size="64KiB") as ckpt:
        ckpt.store.backend = SlowBackend(tmp_path, gate=gate)
        snapshot = copy.deepcopy(state)
        handle = ckpt.save(5, state)
        assert not handle.durable.done(), "persisting is held by the gate"
        # training goes on: forward/backward right away, optimizer.step() waits for staging
        threading.Timer(0.2, gate.set).start()
        _train(state, 3)
        handle.wait(timeout=60)
        assert handle.staged.done()
    fresh = make_state(width=256, trained=0, seed=9)
    with flashckpt.Checkpointer(tmp_path) as ckpt:
        assert ckpt.restore(fresh) == 5
    state_equal(snapshot, fresh)
    assert not torch.equal(state["model"].fc1.weight, fresh["model"].fc1.weight)


def test_buffers_are_copied_at_save_time(tmp_path, make_state):
    """BatchNorm statistics change in forward (before optimizer.step): captured at save()."""
    state = make_state(width=64)
    gate = threading.Event()
    with flashckpt.Checkpointer(tmp_path, async_save=True) as ckpt:
        ckpt.store.backend = SlowBackend(tmp_path, gate=gate)
        mean_at_save = state["model"].bn.running_mean.clone()
        handle = ckpt.save(1, state)
        state["model"](torch.randn(16, 64) * 5)  # forward only: changes running_mean
        assert not torch.equal(state["model"].bn.running_mean, mean_at_save)
        gate.set()
        handle.wait(timeout=60)
    fresh = make_state(width=64, trained=0, seed=2)
    with flashckpt.Checkpointer(tmp_path) as ckpt:
        ckpt.restore(fresh)
    assert torch.equal(fresh["model"].bn.running_mean, mean_at_save)


def test_without_optimizer_save_returns_when_staged(tmp_path):
    t = torch.randn(1 << 18)
    gate = threading.Event()
    with flashckpt.Checkpointer(tmp_path, async_save=True, chunk_size="64KiB") as ckpt:
        ckpt.store.backend = SlowBackend(tmp_path, gate=gate)
        handle = ckpt.save(1, {"t": t})
        assert handle.staged.done() and not handle.durable.done()
        expected = t.clone()
        t.add_(1)  # safe: the snapshot is protected
        gate.set()
        handle.wait(timeout=60)
    out = torch.zeros_like(t)
    with flashckpt.Checkpointer(tmp_path) as ckpt:
        ckpt.restore({"t": out})
    assert torch.equal(out, expected)


def test_state_larger_than_budget_flows_in_waves(tmp_path):
    t = torch.randn(2 << 20)  # 8 MiB through a 1 MiB budget of 256 KiB slots
    with flashckpt.Checkpointer(
        tmp_path, async_save=True, host_memory_budget="1MiB", chunk_size="256KiB"
    ) as ckpt:
        stats = ckpt.save(1, {"t": t}).wait(timeout=60)
        assert ckpt._pool.capacity_bytes <= 1 << 20
    assert stats.total_bytes == t.numel() * 4
    out = torch.zeros_like(t)
    with flashckpt.Checkpointer(tmp_path) as ckpt:
        ckpt.restore({"t": out})
    assert torch.equal(out, t)


def test_background_error_surfaces_on_handle_next_save_and_close(tmp_path, make_state):
    state = make_state()
    ckpt = flashckpt.Checkpointer(tmp_path, async_save=True)
    ckpt.save(1, state).wait()
    ckpt.store.backend = FailingBackend(tmp_path)
    with torch.no_grad():
        state["model"].fc1.weight.add_(1)
    failed = ckpt.save(2, state)
    with pytest.raises(flashckpt.SaveError, match="injected"):
        failed.wait(timeout=60)
    # delivered on the handle: the next save is not blocked by it
    ckpt.store.backend = LocalBackend(tmp_path)
    ckpt.save(3, state).wait()
    # an undelivered failure is raised by the next save() ...
    ckpt.store.backend = FailingBackend(tmp_path)
    with torch.no_grad():
        state["model"].fc1.weight.add_(1)
    h = ckpt.save(4, state)
    while not h.durable.done():
        time.sleep(0.01)
    ckpt.store.backend = LocalBackend(tmp_path)
    with pytest.raises(flashckpt.SaveError, match="step 4"):
        ckpt.save(5, state)
    # ... or by close()
    ckpt.store.backend = FailingBackend(tmp_path)
    with torch.no_grad():
        state["model"].fc1.weight.add_(1)
    ckpt.save(6, state)
    with pytest.raises(flashckpt.SaveError, match="step 6"):
        ckpt.close()
    with flashckpt.Checkpointer(tmp_path) as again:
        assert again.steps() == [1, 3]


def test_busy_wait_and_skip(tmp_path, make_state):
    state = make_state(width=128)
    with flashckpt.Checkpointer(
        tmp_path, async_save=True, on_busy="skip", chunk_size="16KiB"
    ) as ckpt:
        gate = threading.Event()
        ckpt.store.backend = SlowBackend(tmp_path, gate=gate)
        first = ckpt.save(1, state)
        first.staged.result()  # parameters may change outside optimizer.step() once staged
        with torch.no_grad():
            state["model"].fc1.weight.add_(1)
        second = ckpt.save(2, state)
        assert second.skipped and not first.durable.done()
        gate.set()
        first.wait(timeout=60)
        assert ckpt.steps() == [1]
    with flashckpt.Checkpointer(tmp_path, async_save=True, chunk_size="16KiB") as ckpt:
        ckpt.store.backend = SlowBackend(tmp_path, delay_s=0.02)
        with torch.no_grad():
            state["model"].fc1.weight.add_(1)
        a = ckpt.save(3, state)
        a.staged.result()
        with torch.no_grad():
            state["model"].fc1.weight.add_(1)
        b = ckpt.save(4, state)  # waits for 3, counted as blocking
        assert a.durable.done()
        assert b.blocking_s >= 0.02
        b.wait()
        assert ckpt.steps() == [1, 3, 4]


def test_handle_reports_blocking_and_background(tmp_path, make_state):
    with flashckpt.Checkpointer(tmp_path, async_save=True) as ckpt:
        stats = ckpt.save(1, make_state()).wait()
    assert stats.blocking_s > 0 and stats.background_s > 0
    assert stats.background_s >= stats.staged_s
