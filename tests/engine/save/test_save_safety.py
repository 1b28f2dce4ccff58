"""Save-side safety: per-save state on the job, mutation detection, refused input, same step
twice, lock release on a failed __init__, errors delivered once, optimizer hooks by object."""

from __future__ import annotations

import gc
import json
import threading

import numpy as np
import pytest
import torch

import flashckpt
from flashckpt.engine.runtime.lifecycle import RunMarker
from flashckpt.engine.runtime.meter import RunMeter
from flashckpt.engine.save.job import SaveJob
from flashckpt.engine.tiers.tierset import TierSet
from flashckpt.store.files.backend import LocalBackend
from flashckpt.store.store import CheckpointStore


def _events(root, name):
    lines = (root / "journal.jsonl").read_text().splitlines()
    return [e for e in map(json.loads, lines) if e["event"] == name]


def test_durable_callback_uses_its_own_tier_not_the_next_saves(tmp_path, monkeypatch):
    """Step 1 lands in the memory tier; step 2 (saved while step 1's durable callback still
    runs) falls back to the local tier. Step 1 must be journaled and promoted from memory:
    reading a Checkpointer field that save 2 overwrote left step 1 only in memory."""
    root, mem = tmp_path / "root", tmp_path / "mem"
    second_targeted = threading.Event()
    real_target, real_durable = TierSet.target, RunMeter.durable
    calls = {"n": 0}

    def target(self, *, step, nbytes):
        calls["n"] += 1
        tier = real_target(self, step=step, nbytes=nbytes)
        if calls["n"] == 2:
            tier = self.tiers[1]  # as if /dev/shm were full: this save goes to local
            second_targeted.set()
        return tier

    def durable(self, **kw):
        second_targeted.wait(10)  # step 1's callback runs after save 2 chose its tier
        return real_durable(self, **kw)

    monkeypatch.setattr(TierSet, "target", target)
    monkeypatch.setattr(RunMeter, "durable", durable)
    w = torch.arange(1000, dtype=torch.float32)
    with flashckpt.Checkpointer(root, memory_tier=mem, async_save=True) as ck:
        ck.save(1, {"w": w})
        ck.save(2, {"w": w + 1})
        ck.wait_promoted(30)
    tiers = {e["step"]: e["tier"] for e in _events(root, "durable")}
    assert tiers == {1: "memory", 2: "local"}
    assert CheckpointStore(LocalBackend(root)).steps() == [1, 2]


class _HeldStaging:
    """Holds every save's staging until released, so the test can act in between."""

    def __init__(self, monkeypatch):
        self.go = threading.Event()
        real = SaveJob._stage_all

        def held(job):
            self.go.wait(30)
            real(job)

        monkeypatch.setattr(SaveJob, "_stage_all", held)


def test_parameter_changed_outside_optimizer_step_fails_the_save(tmp_path, make_state, monkeypatch):
    """With overlap=True staging runs after save() returns; a parameter changed before it
    finished (SAM's perturbation, local-SGD averaging) would give a checkpoint that mixes two
    states and does not restore what save() saw. The save fails, naming the tensor."""
    held = _HeldStaging(monkeypatch)
    state = make_state()
    with flashckpt.Checkpointer(tmp_path, async_save=True) as ck:
        handle = ck.save(3, state)
        assert not handle.staged.done()
        with torch.no_grad():
            state["model"].fc1.weight.add_(1.0)  # outside optimizer.step()
        held.go.set()
        with pytest.raises(flashckpt.SaveError, match=r"fc1\.weight.*overlap=False"):
            handle.wait(30)
        assert ck.steps() == []  # nothing committed
        state["model"].fc1.weight.grad = None
        ck.save(4, state).wait(30)  # the next save works
        assert ck.steps() == [4]


def test_optimizer_step_after_save_is_not_a_mutation(tmp_path, make_state, monkeypatch):
    held = _HeldStaging(monkeypatch)
    state = make_state()
    with flashckpt.Checkpointer(tmp_path, async_save=True) as ck:
        handle = ck.save(1, state)
        threading.Timer(0.2, held.go.set).start()
        state["optim"].step()  # the pre-step hook waits for staging first
        handle.wait(30)
        assert ck.steps() == [1]


def test_optimizer_hook_installed_on_a_new_optimizer_at_a_reused_id(tmp_path, monkeypatch):
    """Hooks keyed by id(): a new optimizer at a freed one's address got no hook, so its
    step() did not wait for staging. ``id`` is made to collide (as CPython does once the old
    optimizer is freed and its memory reused) so the test does not depend on the allocator."""
    from flashckpt.engine.save import hooks

    monkeypatch.setattr(hooks, "id", lambda obj: 4242, raising=False)
    model = torch.nn.Linear(4, 4)
    with flashckpt.Checkpointer(tmp_path, async_save=True) as ck:
        first = torch.optim.SGD(model.parameters(), lr=0.1)
        ck.save(1, {"model": model, "optim": first}).wait(30)
        del first
        gc.collect()
        second = torch.optim.SGD(model.parameters(), lr=0.1)
        ck.save(2, {"model": model, "optim": second}).wait(30)
        assert len(second._optimizer_step_pre_hooks) == 1


def test_step_beyond_manifest_names_is_refused_before_any_work(tmp_path):
    with flashckpt.Checkpointer(tmp_path) as ck:
        with pytest.raises(flashckpt.ConfigError, match=r"step 1000000000000000 is too large"):
            ck.save(10**15, {"w": torch.ones(3)})
        assert not any(p.is_file() for p in (tmp_path / "chunks").rglob("*"))
        ck.save(10**15 - 1, {"w": torch.ones(3)})
        assert ck.steps() == [10**15 - 1]


def test_numpy_nan_and_inf_scalars_are_saved_and_restored(tmp_path):
    state = {"metrics": {"best": np.float64("nan"), "worst": np.float32("-inf"), "n": np.int64(3)}}
    with flashckpt.Checkpointer(tmp_path) as ck:
        ck.save(1, state)
        out = {"metrics": None}
        assert ck.restore(out) == 1
    got = out["metrics"]
    assert isinstance(got["best"], np.float64) and np.isnan(got["best"])
    assert isinstance(got["worst"], np.float32) and got["worst"] == -np.inf
    assert got["n"] == 3 and isinstance(got["n"], np.int64)


def test_numpy_scalar_json_cannot_hold_is_refused_at_capture_naming_the_key(tmp_path):
    with flashckpt.Checkpointer(tmp_path) as ck:
        with pytest.raises(flashckpt.UnsupportedStateError, match=r"metrics/z"):
            ck.save(1, {"w": torch.ones(1 << 16), "metrics": {"z": np.complex128(1 + 2j)}})
        assert ck.steps() == []
        assert not any(p.is_file() for p in (tmp_path / "chunks").rglob("*"))


def test_same_step_twice_is_refused_naming_step_and_tier(tmp_path):
    """Saving an existing step rewrote only the fastest tier: the tiers then disagreed."""
    mem = tmp_path / "mem"
    with flashckpt.Checkpointer(tmp_path / "root", memory_tier=mem) as ck:
        ck.save(5, {"w": torch.zeros(4)})
        ck.wait_promoted(30)
        with pytest.raises(flashckpt.ConfigError, match=r"step 5 is already committed.*memory"):
            ck.save(5, {"w": torch.ones(4)})
        assert ck.has_step(5) and not ck.has_step(6)
        ck.save(6, {"w": torch.ones(4)})
    out = {"w": torch.empty(4)}
    assert flashckpt.restore(tmp_path / "root", out, step=5) == 5
    assert torch.equal(out["w"], torch.zeros(4))


def test_failed_init_releases_the_writer_lock(tmp_path):
    with pytest.raises(flashckpt.ConfigError):
        flashckpt.Checkpointer(tmp_path, save_policy="every 100")
    with flashckpt.Checkpointer(tmp_path) as ck:  # LockedError while the lock leaked
        ck.save(1, {"w": torch.ones(2)})


def test_init_failing_late_releases_root_and_tier_locks(tmp_path, monkeypatch):
    def broken(self, store, policy, *learners):
        raise OSError(28, "No space left on device (injected)")

    mem = tmp_path / "mem"
    with monkeypatch.context() as m:
        m.setattr(RunMarker, "start", broken)
        with pytest.raises(OSError):
            flashckpt.Checkpointer(tmp_path / "root", memory_tier=mem, async_save=True)
    with flashckpt.Checkpointer(tmp_path / "root", memory_tier=mem) as ck:
        ck.save(1, {"w": torch.ones(2)})


def test_error_seen_through_durable_result_is_not_raised_again(tmp_path, monkeypatch):
    real = CheckpointStore.put_chunk
    fail = {"on": True}

    def put_chunk(self, *a, **kw):
        if fail["on"]:
            raise OSError(5, "Input/output error (injected)")
        return real(self, *a, **kw)

    monkeypatch.setattr(CheckpointStore, "put_chunk", put_chunk)
    with flashckpt.Checkpointer(tmp_path, async_save=True) as ck:
        handle = ck.save(1, {"w": torch.ones(1000)})
        with pytest.raises(flashckpt.SaveError, match="step 1"):
            handle.durable.result(30)
        fail["on"] = False
        ck.save(2, {"w": torch.ones(1000)}).wait(30)  # raised step 1's error again
        assert ck.steps() == [2]


def test_unseen_background_error_still_raised_by_next_save(tmp_path, monkeypatch):
    def put_chunk(self, *a, **kw):
        raise OSError(5, "Input/output error (injected)")

    with flashckpt.Checkpointer(tmp_path, async_save=True) as ck:
        with monkeypatch.context() as m:
            m.setattr(CheckpointStore, "put_chunk", put_chunk)
            handle = ck.save(1, {"w": torch.ones(1000)})
            for _ in range(3000):  # wait without observing the error
                if handle.done():
                    break
                threading.Event().wait(0.01)
        with pytest.raises(flashckpt.SaveError, match="step 1"):
            ck.save(2, {"w": torch.ones(1000)})
        ck.save(3, {"w": torch.ones(1000)}).wait(30)


def test_sigterm_final_save_skips_a_step_already_committed(tmp_path):
    """After SIGTERM the emergency save of a step an earlier run committed is skipped (a
    step is saved once), not journaled as a failed save."""
    import signal

    from flashckpt.engine.runtime.preempt import Preempted

    with flashckpt.Checkpointer(tmp_path) as ck:
        ck.save(5, {"w": torch.zeros(4)})
    ck = flashckpt.Checkpointer(
        tmp_path, save_policy=100, handle_sigterm=True, emergency_save={"w": torch.ones(4)}
    )
    try:
        ck._preempt._on_signal(signal.SIGTERM, None)
        with pytest.raises(Preempted):
            ck.should_save(5)
    finally:
        ck.close()
    assert not _events(tmp_path, "save_failed")
    out = {"w": torch.empty(4)}
    assert flashckpt.restore(tmp_path, out) == 5 and torch.equal(out["w"], torch.zeros(4))


def test_staging_error_of_an_async_save_reaches_the_next_save(tmp_path, monkeypatch):
    """save() waits for staging (no optimizer in the state) without raising; that internal
    wait must not count as the caller having seen the error."""

    def broken(job):
        raise RuntimeError("staging failed (injected)")

    with flashckpt.Checkpointer(tmp_path, async_save=True) as ck:
        with monkeypatch.context() as m:
            m.setattr(SaveJob, "_stage_all", broken)
            ck.save(1, {"w": torch.ones(8)})
        with pytest.raises(flashckpt.SaveError, match="step 1 failed: RuntimeError"):
            ck.save(2, {"w": torch.ones(8)})
