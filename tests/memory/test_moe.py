"""MoE models with transformers' default expert kernel (grouped_mm), against a real CPU step."""

from __future__ import annotations

import pytest
import torch
from hf_tiny import model as tiny
from realstep import measured_peak

from flashckpt.memory import estimate
from flashckpt.memory.trace.kernels import KernelRules

MOE = ["qwen2-moe", "olmoe", "deepseek-v2"]


@pytest.mark.parametrize("name", MOE)
@pytest.mark.parametrize("precision", ["bf16-mixed", "bf16"])
def test_moe_default_kernel_is_traced_within_2_percent(name: str, precision: str) -> None:
    """Under bf16 autocast the experts' fp32 weights reach grouped_mm as fp32: the fake
    kernel used to refuse them (RuntimeError: Expected inputs of BF16 type)."""
    model = tiny(name)
    assert model.config._experts_implementation == "grouped_mm"
    est = estimate(model, device="cpu", batch_size=2, seq_len=128, precision=precision)
    real = measured_peak(model, batch=2, seq=128, precision=precision)
    assert max(est.phase_peaks.values()) == pytest.approx(real, rel=0.02)


def test_moe_default_kernel_with_full_recompute() -> None:
    from flashckpt.memory import find_blocks

    model = tiny("qwen2-moe")
    est = estimate(model, device="cpu", batch_size=2, seq_len=128, recompute="full")
    real = measured_peak(model, batch=2, seq=128, recompute=tuple(find_blocks(model)))
    assert max(est.phase_peaks.values()) == pytest.approx(real, rel=0.02)


def test_grouped_mm_rule_gives_the_real_kernels_output() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    a, b = torch.randn(10, 8), torch.randn(3, 8, 16)
    offs = torch.tensor([3, 7, 10], dtype=torch.int32)
    real = torch.nn.functional.grouped_mm(a, b, offs=offs)
    with FakeTensorMode() as mode, KernelRules():
        fa, fb, fo = (mode.from_tensor(t) for t in (a, b, offs))
        fake = torch.nn.functional.grouped_mm(fa, fb, offs=fo)
        bf = torch.nn.functional.grouped_mm(fa.bfloat16(), fb.bfloat16(), offs=fo)
    assert (fake.shape, fake.dtype) == (real.shape, real.dtype)
    assert bf.dtype == torch.bfloat16 and bf.shape == real.shape
