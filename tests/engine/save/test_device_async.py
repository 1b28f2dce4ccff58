"""The ten GPU-path defects of issue 29, each on the asynchronous CPU stand-in (fake_device.py):
copies and kernels complete later on a worker per fake stream, events complete only after the
work recorded before them, tensors live on one of several fake devices, and the current device
(0) differs from the state's. Every test here failed on the code before the fix.

(Defect 4, the warm-up's pinning, is
test_staging.py::test_warmup_pins_only_where_a_cuda_context_exists; defect 8, the allocator
settings, is tests/memory/test_allocator_settings.py.)"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from fake_device import FakeDevice, PeakAlloc

import flashckpt
from flashckpt.engine.save import fingerprint as fingerprints
from flashckpt.engine.save import staging as staging_mod
from flashckpt.engine.save.fingerprint import Fingerprinter
from flashckpt.engine.save.hooks import copy_unprotected, module_pointers, protected_pointers
from flashckpt.engine.save.staging import StagingPool
from flashckpt.state.capture import capture

CHUNK = "64KiB"
N = 4 * 16384  # four chunks of float32


@pytest.fixture
def fake(monkeypatch) -> Iterator[FakeDevice]:
    f = FakeDevice(delay_s=0.01).install(monkeypatch)
    yield f
    f.close()


def _on(fake: FakeDevice, device: str, n: int = N, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return fake.on(torch.randn(n, generator=g), device)


def _restore(root, like: dict, step: int) -> dict:
    out = {k: torch.zeros_like(v) for k, v in like.items()}  # plain CPU tensors
    assert flashckpt.restore(root, {"p": out}, step=step) == step
    return out


# -- 1. ordering follows the tensor's device, not the current device ---------------------------
@pytest.mark.parametrize("incremental", [True, False])
def test_state_on_cuda1_with_current_device_0_is_staged_after_its_step(tmp_path, fake, incremental):
    """Defect 1: the event was recorded on the current device's stream (0) while the step was
    queued on cuda:1; the incremental save fingerprinted the pre-step bytes, matched the last
    save's, and never wrote the changed chunk."""
    w = {"w": _on(fake, "cuda:1")}
    with flashckpt.Checkpointer(tmp_path, chunk_size=CHUNK, incremental=incremental) as ck:
        ck.save(1, {"p": w})
        fake.launch(lambda: w["w"].mul_(2.0).add_(1.0), "cuda:1", delay_s=0.3)  # the step
        ck.save(2, {"p": w})
    fake.synchronize_all()
    assert torch.equal(_restore(tmp_path, w, 2)["w"], w["w"]), "pre-step bytes were saved"
    assert fake.contexts == {1}, "a CUDA context landed on another GPU than the state's"


def test_state_across_two_devices_is_staged_after_the_work_on_each(tmp_path, fake):
    """Defect 1: one event (current device) and one side stream (the first chunk's device)
    for a state on two GPUs: the other device's chunks were read while their step ran."""
    w = {"a": _on(fake, "cuda:1", seed=1), "b": _on(fake, "cuda:2", seed=2)}
    with flashckpt.Checkpointer(tmp_path, chunk_size=CHUNK, incremental=True) as ck:
        ck.save(1, {"p": w})
        fake.launch(lambda: w["a"].add_(1.0), "cuda:1", delay_s=0.2)
        fake.launch(lambda: w["b"].add_(3.0), "cuda:2", delay_s=0.4)
        ck.save(2, {"p": w})
    fake.synchronize_all()
    got = _restore(tmp_path, w, 2)
    assert torch.equal(got["a"], w["a"]) and torch.equal(got["b"], w["b"])
    assert fake.streams_created == {1: 1, 2: 1}, "one side stream per device"
    assert fake.contexts == {1, 2}


# -- 2. no device clones of parameters with overlap=True ----------------------------------------
class _Lora(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.base = torch.nn.Linear(128, 128)
        self.lora = torch.nn.Linear(128, 8, bias=False)
        self.base.requires_grad_(False)


def _lora_state(fake: FakeDevice) -> dict:
    torch.manual_seed(0)
    model = _Lora()
    for p in model.parameters():
        fake.on(p.data, "cuda:1")
    opt = torch.optim.SGD(model.lora.parameters(), lr=0.1)
    return {"model": model, "optim": opt}


def test_frozen_base_is_not_cloned_on_the_device_and_is_still_guarded(tmp_path, fake, monkeypatch):
    """Defect 2: every tensor outside the optimizer was cloned on the GPU at save() (a LoRA
    base: a second copy in device memory). Frozen parameters are never cloned now; the guard
    still fails a save whose frozen base changed before staging finished."""
    state = _lora_state(fake)
    clones: list[str] = []
    real = torch.Tensor.clone

    def clone(t, *a, **kw):
        if fake.device_of(t) != "cpu":
            clones.append(fake.device_of(t))
        return real(t, *a, **kw)

    monkeypatch.setattr(torch.Tensor, "clone", clone)
    fake.delay_s = 0.05
    with flashckpt.Checkpointer(tmp_path, async_save=True, chunk_size="16KiB") as ck:
        ck.save(1, state).wait()
        assert clones == [], "device clones of parameters"
        h = ck.save(2, state)
        with torch.no_grad():
            state["model"].base.weight.mul_(2.0)  # not a step: the guard must see it
        with pytest.raises(flashckpt.SaveError, match=r"base\.weight"):
            h.wait()
        ck.save(3, state).wait()
    assert clones == []


def test_channels_last_weight_is_not_copied_twice():
    """Defect 2: capture makes a channels_last weight contiguous (a copy taken at save());
    copy_unprotected cloned that copy again."""
    conv = torch.nn.Conv2d(4, 8, 3).to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(conv.parameters(), lr=0.1)
    state = {"model": conv, "optim": opt}
    captured = capture(state)
    before = {i.key: i.data.data_ptr() for i in captured.items}
    copy_unprotected(captured, protected_pointers([opt]) | module_pointers(state))
    assert {i.key: i.data.data_ptr() for i in captured.items} == before


# -- 3. one side stream per device; fingerprints in bounded windows -----------------------------
def test_side_stream_is_made_once_per_device_not_per_save(tmp_path, fake, monkeypatch):
    """Defect 3: a new side stream every save (the caching allocator keeps memory per
    stream: cached device memory spread over one stream per save), each holding the
    fingerprint temporaries of about 4-5 chunks."""
    monkeypatch.setattr(fingerprints, "WINDOW_BYTES", 16 << 10)
    w = {"w": _on(fake, "cuda:1", n=4 * N)}  # 1 MiB chunks
    with flashckpt.Checkpointer(tmp_path, chunk_size="1MiB") as ck:
        for step in range(1, 5):
            w["w"][:10] += 1.0
            ck.save(step, {"p": w})
    assert fake.streams_created == {1: 1}
    held = [s.peak_alloc_bytes for s in fake.streams]
    assert 0 < max(held) <= 8 * (16 << 10), f"{held} bytes cached per side stream (1 MiB chunks)"


@pytest.mark.parametrize("pieces", [1, 3])
def test_fingerprint_temporaries_are_bounded_by_a_window(monkeypatch, pieces):
    """Defect 3: fingerprint temporaries were about 4-5 chunks of int64 per chunk."""
    monkeypatch.setattr(fingerprints, "WINDOW_BYTES", 64 << 10)
    size = 2 << 20
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, 256, (size + 3,), dtype=torch.uint8, generator=g)
    parts = [data[: size // 3 + 1], data[size // 3 + 1 : size], data[size:]][:pieces]
    whole = torch.cat(parts)
    fp = Fingerprinter(seeds=(3, 5))
    expect = fp.of_parts([whole])
    with PeakAlloc() as peak:
        got = fp.of_parts(parts)
    assert got == expect, "windows and pieces change nothing"
    assert peak.peak <= 8 * (64 << 10), f"{peak.peak} bytes of temporaries for a 2 MiB chunk"


# -- 5. pinned memory within the budget, freed on growth and at close ---------------------------
def test_pinned_arena_stays_within_the_budget_over_20_growing_saves(tmp_path, fake):
    """Defect 5: an arena that grew kept the old pinned blocks in torch's cache, close kept
    them too, and the misaligned fallback asked for twice the size."""
    budget = 1 << 20
    with flashckpt.Checkpointer(
        tmp_path, chunk_size=CHUNK, host_memory_budget=budget, incremental=False
    ) as ck:
        for step in range(1, 21):
            n = 16384 * (1 + step % 16)  # grows to the budget, in steps of one chunk
            ck.save(step, {"p": {"w": _on(fake, "cuda:1", n=n, seed=step)}})
            assert fake.pinned_bytes <= budget, f"step {step}: {fake.pinned_bytes} pinned"
    assert 0 < fake.pinned_peak_bytes <= budget
    assert fake.pinned_bytes == 0, "close left pinned memory cached"


def test_pinned_arena_is_page_locked_in_pieces_and_unlocked_on_growth_and_close(fake, monkeypatch):
    """Issue 29, defect 4: the warm-up pinned the whole arena with one cudaHostAlloc, holding
    the driver's global lock for seconds per GB (the training thread's launches waited). Now
    it is page-locked in pieces, each a short call; growth unlocks the old arena before the
    new one is locked, and close unlocks everything."""
    monkeypatch.setattr(staging_mod, "PIN_PIECE", 256 << 10)
    pool = staging_mod.StagingPool(budget_bytes=4 << 20, chunk_bytes=256 << 10)
    pool.reserve(needed_bytes=1 << 20, pin=True, device="cuda:1")
    assert pool.pinned and fake.is_pinned(pool.view(4096, 16))
    assert fake.registers == 4 and fake.largest_pin_bytes == 256 << 10
    assert fake.registered_bytes == 1 << 20 and 1 in fake.contexts
    pool.reserve(needed_bytes=3 << 20, pin=True)  # grows: the old pieces are unlocked first
    assert fake.registered_bytes == 3 << 20 and fake.pinned_peak_bytes == 3 << 20
    pool.close()
    assert fake.registered_bytes == 0


def test_a_piece_that_cannot_be_pinned_leaves_nothing_locked_and_stages_pageable(fake, monkeypatch):
    monkeypatch.setattr(staging_mod, "PIN_PIECE", 256 << 10)
    fake.fail_register_at = 3
    pool = staging_mod.StagingPool(budget_bytes=4 << 20, chunk_bytes=256 << 10)
    pool.reserve(needed_bytes=1 << 20, pin=True, device="cuda:0")
    assert not pool.pinned and pool.capacity_bytes == 1 << 20
    assert fake.registered_bytes == 0, "the two pieces locked before the failure stay locked"
    pool.view(0, 8).fill_(7)  # pageable, and usable


# -- 6. non_blocking D2H copies into pinned CPU tensors of the state are waited on ---------------
def test_pinned_cpu_tensor_filled_by_a_non_blocking_copy_is_read_after_it_lands(tmp_path, fake):
    """Defect 6: a pinned CPU tensor that a non_blocking device-to-host copy was still filling
    was saved without waiting (its old bytes: zeros)."""
    dev = _on(fake, "cuda:1", n=4096)
    host = fake.pinned_tensor(4096)
    fake.delay_s = 0.3
    host.copy_(dev, non_blocking=True)  # queued on cuda:1's current stream
    with flashckpt.Checkpointer(tmp_path) as ck:
        ck.save(1, {"p": {"h": host}})
    assert torch.equal(_restore(tmp_path, {"h": host}, 1)["h"], dev)


# -- 7. the guard sees writes through .data; CUDA-graph (capturable) steps do not overlap --------
def _model_state(fake: FakeDevice, **opt_kw) -> dict:
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    for p in model.parameters():
        fake.on(p.data, "cuda:1")
    return {"model": model, "optim": torch.optim.SGD(model.parameters(), lr=0.1, **opt_kw)}


def test_data_update_between_save_and_step_fails_the_save(tmp_path, fake):
    """Defect 7: ``p.data.mul_()`` moves no version counter the guard watched; the save
    committed a checkpoint mixing two states."""
    state = _model_state(fake)
    fake.delay_s = 0.1
    with flashckpt.Checkpointer(tmp_path, async_save=True, chunk_size="4KiB") as ck:
        h = ck.save(1, state)
        state["model"].weight.data.mul_(0.5)  # an EMA-style write outside optimizer.step()
        with pytest.raises(flashckpt.SaveError, match="weight"):
            h.wait()
    assert "data" not in torch.Tensor.__dict__, "the .data watch outlived the save"


def test_capturable_optimizer_is_copied_at_save_not_overlapped(tmp_path, fake):
    """Defect 7: a CUDA-graph replay of the step calls no pre-step hook; an optimizer with
    capturable=True must not overlap staging with it."""
    state = _model_state(fake, momentum=0.9)
    for group in state["optim"].param_groups:
        group["capturable"] = True  # (what graph-captured optimizers set)
    fake.delay_s = 0.1
    with flashckpt.Checkpointer(tmp_path, async_save=True, chunk_size="4KiB") as ck:
        h = ck.save(1, state)
        assert h.staged.done(), "save() returned before the state was staged"
        h.wait()


# -- 9. a staging range is not released while a copy into it may be in flight -------------------
def test_staging_range_is_not_released_while_a_copy_into_it_is_in_flight(
    tmp_path, fake, monkeypatch
):
    """Defect 9: when a copy of a chunk failed, its range went back to the pool while the
    chunk's earlier non_blocking copies were still landing in it."""
    small = {f"t{i}": _on(fake, "cuda:1", n=256, seed=i) for i in range(4)}  # one packed chunk
    at_release: list[int] = []
    real = StagingPool.release

    def release(self, start):
        at_release.append(fake.pending())
        return real(self, start)

    monkeypatch.setattr(StagingPool, "release", release)
    fake.delay_s = 0.2
    with flashckpt.Checkpointer(tmp_path, incremental=False) as ck:
        fake.fail_copy_at = fake.copies + 2  # the second piece's copy fails to launch
        with pytest.raises(flashckpt.SaveError, match="injected"):
            ck.save(1, {"p": small})
        assert at_release and all(n == 0 for n in at_release), at_release
        fake.fail_copy_at = None
        ck.save(2, {"p": small})
    got = _restore(tmp_path, small, 2)
    assert all(torch.equal(got[k], small[k]) for k in small)


# -- 10. restore's copies are ordered against the user's current stream -------------------------
def test_restore_copies_run_after_the_work_queued_on_the_users_stream(tmp_path, fake):
    """Defect 10: restore's host-to-device copies ran on the reader threads' default streams,
    unordered with a fill the user had queued on their own stream: it overwrote them."""
    w = {"w": _on(fake, "cuda:1")}
    saved = w["w"].clone()
    with flashckpt.Checkpointer(tmp_path, chunk_size=CHUNK) as ck:
        ck.save(1, {"p": w})
    user = fake.stream("cuda:1")
    with fake.use(user):
        fake.launch(lambda: w["w"].fill_(7.0), "cuda:1", delay_s=0.4)  # the user's work
        assert flashckpt.restore(tmp_path, {"p": w}) == 1
    fake.synchronize_all()
    assert torch.equal(w["w"], saved), "the user's queued work overwrote the restored bytes"
