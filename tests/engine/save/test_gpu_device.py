"""The GPU-path defects of issue 29 on a real device (the stand-in twins are in
test_device_async.py). Marked ``gpu``; skipped cleanly without CUDA; the layouts that need two
GPUs skip with that reason on one."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

import flashckpt
from flashckpt.memory import AllocatorSettings, apply_allocator_settings

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
two_gpus = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two GPUs"
)
MIB = 1 << 20


def _slow_then(fn, device) -> None:
    """Queue ~50 ms of GPU time, then ``fn``, on ``device``'s current stream."""
    with torch.cuda.device(device):
        torch.cuda._sleep(50_000_000)
        fn()


def _restore(root, like: dict, step: int) -> dict:
    out = {k: torch.zeros_like(v, device="cpu") for k, v in like.items()}
    assert flashckpt.restore(root, {"p": out}, step=step) == step
    return out


@pytest.mark.parametrize("incremental", [True, False])
def test_step_queued_before_save_is_in_the_checkpoint(tmp_path, incremental):
    dev = "cuda:1" if torch.cuda.device_count() > 1 else "cuda:0"
    torch.cuda.set_device(0)  # the current device differs from the state's on two GPUs
    w = {"w": torch.randn(16 * MIB // 4, device=dev)}
    with flashckpt.Checkpointer(tmp_path, chunk_size="1MiB", incremental=incremental) as ck:
        ck.save(1, {"p": w})
        _slow_then(lambda: w["w"].mul_(2.0).add_(1.0), dev)
        ck.save(2, {"p": w})
        assert len(ck._saver.streams) == 1, "one side stream, on the state's device"
    assert torch.equal(_restore(tmp_path, w, 2)["w"], w["w"].cpu())


@two_gpus
def test_no_context_on_gpu0_for_a_state_on_cuda1(tmp_path):
    code = textwrap.dedent(
        f"""
        import torch, flashckpt
        w = {{"w": torch.randn(1 << 20, device="cuda:1")}}
        with flashckpt.Checkpointer({str(tmp_path)!r}, async_save=True) as ck:
            ck.save(1, {{"p": w}}).wait()
            w["w"].add_(1)
            ck.save(2, {{"p": w}}).wait()
        print("ctx0", torch._C._cuda_hasPrimaryContext(0))
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "ctx0 False" in out.stdout, out.stdout


@two_gpus
def test_state_across_two_devices(tmp_path):
    w = {
        "a": torch.randn(8 * MIB // 4, device="cuda:0"),
        "b": torch.randn(8 * MIB // 4, device="cuda:1"),
    }
    with flashckpt.Checkpointer(tmp_path, chunk_size="1MiB", incremental=True) as ck:
        ck.save(1, {"p": w})
        _slow_then(lambda: w["a"].add_(1.0), "cuda:0")
        _slow_then(lambda: w["b"].add_(3.0), "cuda:1")
        ck.save(2, {"p": w})
        assert len(ck._saver.streams) == 2
    got = _restore(tmp_path, w, 2)
    assert torch.equal(got["a"], w["a"].cpu()) and torch.equal(got["b"], w["b"].cpu())


def test_lora_frozen_base_is_not_copied_in_device_memory(tmp_path):
    torch.manual_seed(0)
    base = torch.nn.Linear(8192, 8192, bias=False).cuda().requires_grad_(False)  # 256 MiB
    lora = torch.nn.Linear(8192, 16, bias=False).cuda()
    model = torch.nn.ModuleDict({"base": base, "lora": lora})
    opt = torch.optim.AdamW(lora.parameters(), lr=1e-3)
    state = {"model": model, "optim": opt}
    base_bytes = base.weight.numel() * 4
    with flashckpt.Checkpointer(tmp_path, async_save=True, chunk_size="32MiB") as ck:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        h = ck.save(1, state)
        h.wait()
        grown = torch.cuda.max_memory_allocated() - before
    assert grown < base_bytes // 4, f"a save of a LoRA model took {grown} bytes of device memory"


def _pinned() -> int:
    return int(torch.cuda.host_memory_stats().get("allocated_bytes.current", 0))


def test_pinned_memory_stays_within_the_budget_over_20_saves(tmp_path):
    budget = 64 * MIB
    torch.cuda.synchronize()
    torch._C._host_emptyCache()  # what earlier tests left cached
    base = _pinned()
    with flashckpt.Checkpointer(
        tmp_path, async_save=True, chunk_size="4MiB", host_memory_budget=budget
    ) as ck:
        for step in range(1, 21):
            n = (1 + step % 8) * 4 * MIB // 4  # grows, in steps of a chunk
            ck.save(step, {"p": {"w": torch.randn(n, device="cuda")}}).wait()
            held = _pinned() - base
            assert held <= budget, f"step {step}: {held} bytes pinned"
    held = _pinned() - base
    assert held <= 0, f"close left {held} bytes pinned"


def test_data_update_between_save_and_step_never_mixes_states(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Linear(8192, 8192, bias=False).cuda()  # 256 MiB: staging takes a while
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    state = {"model": model, "optim": opt}
    before = model.weight.detach().cpu().clone()
    with flashckpt.Checkpointer(tmp_path, async_save=True, incremental=False) as ck:
        h = ck.save(1, state)
        model.weight.data.mul_(0.5)  # outside optimizer.step()
        try:
            h.wait()
        except flashckpt.SaveError as exc:
            assert "weight" in str(exc)
            return
    fresh = torch.nn.Linear(8192, 8192, bias=False)
    fresh_opt = torch.optim.SGD(fresh.parameters(), lr=0.1)
    assert flashckpt.restore(tmp_path, {"model": fresh, "optim": fresh_opt}) == 1
    assert torch.equal(fresh.weight, before), "the checkpoint mixed two states"


def test_non_blocking_copy_into_a_pinned_state_tensor_is_waited_on(tmp_path):
    dev = torch.randn(64 * MIB // 4, device="cuda")
    host = torch.empty(dev.numel(), pin_memory=True)
    torch.cuda._sleep(50_000_000)
    host.copy_(dev, non_blocking=True)
    with flashckpt.Checkpointer(tmp_path) as ck:
        ck.save(1, {"p": {"h": host}})
    assert torch.equal(_restore(tmp_path, {"h": host}, 1)["h"], dev.cpu())


def test_restore_is_ordered_against_the_users_stream(tmp_path):
    w = {"w": torch.randn(16 * MIB // 4, device="cuda")}
    saved = w["w"].cpu()
    with flashckpt.Checkpointer(tmp_path) as ck:
        ck.save(1, {"p": w})
    user = torch.cuda.Stream()
    with torch.cuda.stream(user):
        torch.cuda._sleep(100_000_000)
        w["w"].fill_(7.0)
        assert flashckpt.restore(tmp_path, {"p": w}) == 1
    torch.cuda.synchronize()
    assert torch.equal(w["w"].cpu(), saved)


def test_fingerprints_use_bounded_device_memory(tmp_path):
    w = {"w": torch.randn(256 * MIB // 4, device="cuda")}
    with flashckpt.Checkpointer(tmp_path, chunk_size="64MiB", incremental=True) as ck:
        ck.save(1, {"p": w})
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        ck.save(2, {"p": w})  # unchanged: fingerprints only
        grown = torch.cuda.max_memory_allocated() - before
    assert grown <= 64 * MIB, f"fingerprints took {grown} bytes (4-5 chunks before the fix)"


def test_warmup_makes_no_cuda_context(tmp_path):
    with flashckpt.Checkpointer(tmp_path) as ck:
        ck.save(1, {"p": {"w": torch.randn(1 << 20)}})
    code = textwrap.dedent(
        f"""
        import torch, flashckpt
        ck = flashckpt.Checkpointer({str(tmp_path)!r})
        ck._warmup.done.wait(60)
        has = torch._C._cuda_hasPrimaryContext
        print("ctx", any(has(i) for i in range(torch.cuda.device_count())))
        ck.close()
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "ctx False" in out.stdout, out.stdout


def test_allocator_fraction_for_a_gc_threshold_on_the_used_device():
    torch.zeros(1, device="cuda")  # a context on the current device
    actions = apply_allocator_settings(AllocatorSettings(garbage_collection_threshold=0.95))
    assert any("fraction 1.0" in a for a in actions), actions
    assert any("CUDA already initialised" in a for a in actions), actions
