"""The traced estimate against a real run of the same step, metered the same way (CPU)."""

from __future__ import annotations

import pytest
import torch
from hf_tiny import model as tiny

from flashckpt.errors import ConfigError
from flashckpt.memory import estimate
from flashckpt.memory.options import EstimateOptions
from flashckpt.memory.trace.measure import trace_model

B, S = 2, 16

NO_DROPOUT = {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}
CASES = [
    ("gpt2", {}, None, 1),  # gelu_new, dropout 0.1 (HF's defaults)
    ("gpt2", NO_DROPOUT, "full", 2),
    ("llama", {}, None, 1),  # GQA, SwiGLU
    ("llama", {}, 1, 2),
    ("mixtral", {}, None, 2),  # MoE, top-2 of 4 experts
    ("mixtral", {}, "full", 1),
    ("gemma", {}, None, 2),  # head_dim != hidden / heads
    ("gemma", {}, "full", 1),
]


def _id(case: tuple) -> str:
    name, over, rec, accum = case
    return f"{name}{'-nodrop' if over else ''}-rec={rec}-accum={accum}"


@pytest.mark.parametrize("case", CASES, ids=[_id(c) for c in CASES])
def test_traced_peak_equals_a_real_run_of_the_same_step(case: tuple) -> None:
    name, overrides, recompute, accum = case
    model = tiny(name, **overrides)
    opts = EstimateOptions(batch_size=B, seq_len=S, recompute=recompute, grad_accum=accum)
    real = trace_model(model, opts, device="cpu", fake=False)
    est = estimate(
        model, device="cpu", batch_size=B, seq_len=S, recompute=recompute, grad_accum=accum
    )
    assert est.method == "traced" and not real.fake
    assert max(est.phase_peaks.values()) == pytest.approx(real.peak_bytes, rel=0.02)
    for phase, peak in real.peaks.items():
        assert est.phase_peaks[phase] == pytest.approx(peak, rel=0.02), phase
    assert est.allocated_peak_bytes == max(est.phase_peaks.values())  # a CPU run: no workspace
    assert est.context_bytes == 0 and est.breakdown["workspace"] == 0


def test_trace_leaves_the_model_as_it_was() -> None:
    model = tiny("llama").eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ids = [id(p) for p in model.parameters()]
    rng = torch.get_rng_state()
    estimate(model, device="cuda", batch_size=B, seq_len=S, recompute="full")
    assert torch.equal(torch.get_rng_state(), rng)
    assert [id(p) for p in model.parameters()] == ids
    assert not model.training and all(not m.training for m in model.modules())
    assert all("forward" not in m.__dict__ for m in model.modules())
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key
    assert all(p.grad is None for p in model.parameters())


def test_meta_model_is_traced_without_memory() -> None:
    import transformers
    from hf_tiny import config

    with torch.device("meta"):
        meta = transformers.AutoModelForCausalLM.from_config(config("llama"))
    got = estimate(meta, device="cpu", batch_size=B, seq_len=S)
    want = estimate(tiny("llama"), device="cpu", batch_size=B, seq_len=S)
    assert got.phase_peaks == want.phase_peaks


def test_foreach_adamw_needs_a_param_sized_temporary() -> None:
    """PyTorch's default AdamW (foreach) holds sqrt(v) for every parameter at the step."""
    model = tiny("gpt2")
    params = sum(p.numel() for p in model.parameters())
    kw = dict(device="cpu", batch_size=1, seq_len=4)
    foreach = estimate(model, optimizer_impl="foreach", **kw)
    fused = estimate(model, optimizer_impl="fused", **kw)
    assert foreach.breakdown["optimizer_temp"] == 4 * params
    assert fused.breakdown["optimizer_temp"] < params // 10
    assert foreach.phase_peaks["optimizer"] - fused.phase_peaks["optimizer"] >= 4 * params * 0.95


def test_grad_accumulation_keeps_fp32_grads_through_the_next_forward() -> None:
    model = tiny("llama")
    params = sum(p.numel() for p in model.parameters())
    one = estimate(model, device="cpu", batch_size=B, seq_len=S)
    two = estimate(model, device="cpu", batch_size=B, seq_len=S, grad_accum=2)
    assert two.phase_peaks["forward"] - one.phase_peaks["forward"] >= 4 * params * 0.99


def test_traced_refuses_what_it_cannot_trace() -> None:
    model = tiny("llama")
    with pytest.raises(ConfigError, match="tensor_parallel"):
        estimate(model, device="cpu", batch_size=1, seq_len=4, world_size=2, tensor_parallel=2)
    with pytest.raises(ConfigError, match="requires_grad"):
        estimate(model, device="cpu", batch_size=1, seq_len=4, trainable_fraction=0.1)
    with pytest.raises(ConfigError, match="inputs="):
        estimate(torch.nn.Linear(2, 2), method="traced", batch_size=1, seq_len=2)
    eager_moe = tiny("mixtral", experts_implementation="eager")
    with pytest.raises(ConfigError, match="experts_implementation"):
        estimate(eager_moe, device="cpu", batch_size=1, seq_len=4)


def test_any_module_with_inputs_and_loss() -> None:
    net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.Linear(32, 8))

    def inputs(b: int, s: int, device: torch.device) -> dict:
        return {"input": torch.randn(b, s, 8, device=device)}

    est = estimate(
        net,
        inputs=inputs,
        loss_fn=lambda y: y.pow(2).mean(),
        device="cpu",
        batch_size=4,
        seq_len=3,
        precision="fp32",
    )
    assert est.method == "traced" and est.breakdown["params"] == 4 * (8 * 32 + 32 + 32 * 8 + 8)


def test_cuda_rules_on_cpu_use_a_fused_attention_kernel() -> None:
    """Without CUDA, device='cuda' emulates CUDA's SDPA choice: no s x s scores saved, even
    with HF GPT-2's attention dropout (on CPU a dropout sends SDPA to the math path)."""
    model = tiny("gpt2", n_positions=256)  # attn_pdrop 0.1

    def acts(seq: int, device: str) -> int:
        est = estimate(model, device=device, batch_size=1, seq_len=seq, optimizer="sgd")
        return est.breakdown["activations"]

    cuda = acts(256, "cuda") / acts(128, "cuda")
    cpu = acts(256, "cpu") / acts(128, "cpu")
    assert cuda <= 2.05  # linear in the sequence (the outer terms grow a little slower)
    assert cpu > cuda + 0.3  # CPU's math path saves the quadratic scores


def test_adafactor_is_traced_within_2_percent_of_a_real_step() -> None:
    """torch.optim.Adafactor reads .item() of norms and the step count: it used to be
    refused as "data-dependent shapes, e.g. an MoE"."""
    from realstep import measured_peak

    for impl, real_name in (("foreach", "adafactor"), ("for-loop", "adafactor-for-loop")):
        model = tiny("llama")
        kw = dict(batch_size=2, seq_len=64, optimizer="adafactor", optimizer_impl=impl)
        est = estimate(model, device="cpu", **kw)
        real = measured_peak(model, batch=2, seq=64, optimizer=real_name)
        assert max(est.phase_peaks.values()) == pytest.approx(real, rel=0.02), impl


def test_a_scalar_read_in_forward_names_the_line_that_reads_it() -> None:
    class Reads(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            scale = x.abs().max().item()  # the line the error must name
            return self.lin(x) * scale

    def inputs(b: int, s: int, device: torch.device) -> dict:
        return {"x": torch.randn(b, s, 4, device=device)}

    with pytest.raises(ConfigError) as info:
        estimate(
            Reads(), inputs=inputs, loss_fn=lambda y: y.sum(), device="cpu", batch_size=1, seq_len=2
        )
    text = str(info.value)
    assert "test_traced.py" in text and "x.abs().max().item()" in text and "MoE" not in text[:80]
    assert ".item()" in text
