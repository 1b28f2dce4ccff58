"""Encoder-decoder models (T5): the planner sees both stacks, and recomputing them is sized
as a real CPU step measures it."""

from __future__ import annotations

import pytest
import torch
import transformers
from realstep import measured_peak

from flashckpt.memory import estimate, find_blocks


def _t5() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.T5Config(
        vocab_size=97,
        d_model=64,
        d_ff=128,
        num_layers=3,
        num_decoder_layers=3,
        num_heads=4,
        d_kv=16,
        dropout_rate=0.0,
        decoder_start_token_id=0,
    )
    return transformers.T5ForConditionalGeneration(config)


def test_find_blocks_sees_encoder_and_decoder_blocks() -> None:
    """It found only the encoder's (the first uniform list of the largest length)."""
    names = find_blocks(_t5())
    assert names == [f"encoder.block.{i}" for i in range(3)] + [
        f"decoder.block.{i}" for i in range(3)
    ]


@pytest.mark.parametrize("recompute", [None, "full"])
def test_t5_recompute_is_sized_as_a_real_step(recompute: str | None) -> None:
    model = _t5()
    est = estimate(model, device="cpu", batch_size=2, seq_len=64, recompute=recompute)
    blocks = tuple(find_blocks(model)) if recompute else ()
    real = measured_peak(model, batch=2, seq=64, recompute=blocks)
    assert max(est.phase_peaks.values()) == pytest.approx(real, rel=0.02)


def test_full_recompute_of_t5_stores_less_than_encoder_only() -> None:
    model = _t5()
    kw = dict(device="cpu", batch_size=2, seq_len=64)
    full = estimate(model, recompute="full", **kw).breakdown["activations"]
    encoder = estimate(model, recompute=[f"encoder.block.{i}" for i in range(3)], **kw)
    assert full < encoder.breakdown["activations"]
