"""ZeRO stages 1-3 in mixed precision: model states as the ZeRO paper counts them.

Rajbhandari et al. 2020, section 3.1: a 16-bit model (2 bytes of parameters, 2 of gradients per
parameter) and 12 bytes of fp32 optimizer state (master weights, Adam's two moments); stage 1
shards the 12 over N ranks (4Psi + 12Psi/N), stage 2 the gradients too (2Psi + 14Psi/N), stage 3
everything (16Psi/N). The trace measures autocast (fp32 parameters and gradients); the estimate
turns that into the stage's states.
"""

from __future__ import annotations

import pytest
from hf_tiny import model as tiny

from flashckpt.memory import build_hf_model, estimate, hf_config, model_state_breakdown

STATES = ("params", "grads", "optimizer", "master_weights")


def _states(est: object) -> int:
    return sum(est.breakdown[k] for k in STATES)  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("stage", "per_param"),
    [(1, lambda n: 4 + 12 / n), (2, lambda n: 2 + 14 / n), (3, lambda n: 16 / n)],
)
def test_traced_zero_model_states_follow_the_paper(stage: int, per_param: object) -> None:
    model = tiny("llama")
    psi = sum(p.numel() for p in model.parameters())
    for n in (2, 8):
        est = estimate(model, device="cpu", batch_size=1, seq_len=8, zero_stage=stage, world_size=n)
        assert _states(est) == pytest.approx(per_param(n) * psi, rel=1e-3)  # type: ignore[operator]
        formula = model_state_breakdown(psi, zero_stage=stage, world_size=n)
        assert _states(est) == pytest.approx(sum(formula.values()), rel=1e-3)


def test_llama3_8b_on_8_gpus_zero1_zero2_model_states() -> None:
    """The issue's numbers: 44.2 / 30.1 GB (it measured 72.3 / 44.2 GB before)."""
    model = build_hf_model(hf_config("llama-3-8b"))
    got = {}
    for stage in (1, 2):
        est = estimate(model, device="cpu", batch_size=1, seq_len=8, zero_stage=stage, world_size=8)
        got[stage] = _states(est) / 1e9
    assert got[1] == pytest.approx(44.2, abs=0.1) and got[2] == pytest.approx(30.1, abs=0.1)


def test_zero_mixed_drops_autocasts_weight_copies_only() -> None:
    """A ZeRO 16-bit model computes with its own weights: no cached 16-bit copies, so its
    activations are the autocast trace's minus the copies (a positive, parameter-sized term)."""
    model = tiny("llama")
    psi = sum(p.numel() for p in model.parameters())
    plain = estimate(model, device="cpu", batch_size=2, seq_len=16)
    z1 = estimate(model, device="cpu", batch_size=2, seq_len=16, zero_stage=1, world_size=1)
    copies = plain.breakdown["activations"] - z1.breakdown["activations"]
    assert 0 < copies <= 2 * psi and plain.breakdown["logits"] == z1.breakdown["logits"]


def test_zero_in_fp32_shards_fp32_states() -> None:
    model = tiny("llama")
    psi = sum(p.numel() for p in model.parameters())
    est = estimate(
        model, device="cpu", batch_size=1, seq_len=8, precision="fp32", zero_stage=1, world_size=4
    )
    assert _states(est) == pytest.approx((4 + 4 + 8 / 4) * psi, rel=1e-3)
