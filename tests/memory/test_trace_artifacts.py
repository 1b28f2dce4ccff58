"""The trace runs HF's code as a real step runs it: no tracing-only paths.

Hugging Face builds an s x s attention mask and repeats K/V heads for SDPA when it believes it
is traced (``transformers.utils.import_utils.is_tracing`` is true for a FakeTensor). Those
tensors exist only in the trace; counted, they add 2-5% on decoders. The test records every
SDPA call of the fake trace and of a real step and requires the same calls (mask, K/V heads,
GQA flag) and the same peak."""

from __future__ import annotations

from typing import Any

import pytest
import torch.nn.functional as F
from hf_tiny import model as tiny
from torch.overrides import TorchFunctionMode

from flashckpt.memory.options import EstimateOptions
from flashckpt.memory.trace.measure import trace_model


class _SdpaCalls(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[Any, ...]] = []

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            mask = kwargs.get("attn_mask", args[3] if len(args) > 3 else None)
            self.calls.append(
                (
                    tuple(args[1].shape),
                    None if mask is None else tuple(mask.shape),
                    kwargs.get("enable_gqa", False),
                    kwargs.get("is_causal", False),
                )
            )
        return func(*args, **kwargs)


@pytest.mark.parametrize("name", ["llama", "qwen2-moe", "gemma"])
def test_fake_trace_makes_the_same_attention_calls_as_a_real_step(name: str) -> None:
    model = tiny(name)
    opts = EstimateOptions(batch_size=2, seq_len=64)
    fake_calls, real_calls = _SdpaCalls(), _SdpaCalls()
    with fake_calls:
        fake = trace_model(model, opts, device="cpu")
    with real_calls:
        real = trace_model(model, opts, device="cpu", fake=False)
    assert fake_calls.calls and fake_calls.calls == real_calls.calls
    assert all(mask is None for _, mask, _, _ in fake_calls.calls)  # no s x s mask built
    heads = model.config.num_key_value_heads
    assert all(k[1] == heads for k, _, _, _ in fake_calls.calls)  # K/V heads not repeated
    assert fake.peaks == real.peaks
