from __future__ import annotations

import pytest
import torch

from flashckpt.errors import ConfigError
from flashckpt.memory import (
    BREAKDOWN_KEYS,
    TransformerShape,
    estimate,
    model_state_bytes,
    shape_by_name,
    shape_from_hf_config,
)
from flashckpt.memory import activations as act
from flashckpt.memory.estimate import EstimateOptions

PSI = 8 * 10**9  # divisible by every world size used below


@pytest.mark.parametrize(
    ("precision", "optimizer", "per_param"),
    [
        ("bf16-mixed", "adamw", 16),  # ZeRO paper: 2 + 2 + 12
        ("fp16-mixed", "adam", 16),
        ("fp32", "adamw", 16),  # 4 + 4 + 8
        ("bf16", "adamw", 8),  # 2 + 2 + 2*2
        ("fp32", "sgd", 8),
        ("fp32", "sgd-momentum", 12),
        ("bf16-mixed", "sgd", 8),  # 2 + 2 + 4 master
    ],
)
def test_model_state_bytes_per_param(precision: str, optimizer: str, per_param: int) -> None:
    assert model_state_bytes(PSI, precision=precision, optimizer=optimizer) == per_param * PSI


@pytest.mark.parametrize(
    ("stage", "expected"),
    [(0, 16 * PSI), (1, 4 * PSI + 12 * PSI // 8), (2, 2 * PSI + 14 * PSI // 8), (3, 16 * PSI // 8)],
)
def test_zero_stages_follow_the_zero_paper(stage: int, expected: int) -> None:
    assert model_state_bytes(PSI, zero_stage=stage, world_size=8) == expected


def test_bad_precision_names_accepted_values() -> None:
    with pytest.raises(ConfigError, match=r"fp32, bf16-mixed, fp16-mixed, bf16"):
        model_state_bytes(10, precision="fp8")
    with pytest.raises(ConfigError, match="adamw"):
        estimate("gpt2", batch_size=1, seq_len=8, optimizer="lion")
    with pytest.raises(ConfigError, match="zero_stage"):
        model_state_bytes(10, zero_stage=4)
    with pytest.raises(ConfigError, match="batch_size"):
        estimate("gpt2", batch_size=0, seq_len=8)


def _korthikanti(s: int, b: int, h: int, a: int, t: int = 1, sp: bool = False) -> float:
    if sp:
        return s * b * h / t * (34 + 5 * a * s / h)
    return s * b * h * (10 + 24 / t + 5 * a * s / (h * t))


@pytest.mark.parametrize(("name", "s", "b"), [("gpt2", 1024, 4), ("gpt2-xl", 2048, 1)])
@pytest.mark.parametrize(("t", "sp"), [(1, False), (2, False), (4, False), (4, True)])
def test_layer_activations_match_korthikanti(name: str, s: int, b: int, t: int, sp: bool) -> None:
    shape = shape_by_name(name)
    opts = act.ActivationOptions(
        act_bytes=2,
        residual_bytes=2,
        flash_attention=False,
        dropout=True,
        tensor_parallel=t,
        sequence_parallel=sp,
    )
    got = act.layer_activation_bytes(shape, batch_size=b, seq_len=s, opts=opts)
    # the only extra terms are fp32 norm statistics: 16 bytes per token (< 0.1%)
    assert got == pytest.approx(_korthikanti(s, b, shape.hidden, shape.heads, t, sp), rel=1e-3)


def test_selective_and_full_recompute_follow_the_paper() -> None:
    shape, s, b = shape_by_name("gpt2-medium"), 2048, 2
    base = dict(batch_size=b, seq_len=s, precision="bf16", flash_attention=False, dropout=True)
    none = estimate(shape, **base).breakdown["activations"]
    selective = estimate(shape, recompute="selective", **base).breakdown["activations"]
    full = estimate(shape, recompute="full", **base).breakdown["activations"]
    h, a, L = shape.hidden, shape.heads, shape.layers
    assert none - selective == L * 5 * a * s * s * b  # section 5: the 5as^2b terms go
    per_layer = none // L  # approximately; outer activations are small
    assert full < none / 5
    assert full == pytest.approx(L * 2 * s * b * h + per_layer, rel=0.02)


def test_estimate_breakdown_and_phase_aware_peak() -> None:
    est = estimate("gpt2", batch_size=8, seq_len=1024)
    assert tuple(est.breakdown) == BREAKDOWN_KEYS
    assert est.total_bytes == sum(est.breakdown.values())
    # gradients (and the optimizer step's temporary) and activations are never both at full
    # size: the peak leaves them out
    left_out = est.breakdown["grads"] + est.breakdown["optimizer_temp"]
    assert est.peak_bytes == est.total_bytes - left_out
    assert est.method == "formula"
    assert est.fits(est.peak_bytes) and not est.fits(est.peak_bytes - 1)
    bigger = estimate("gpt2", batch_size=16, seq_len=1024)
    assert bigger.breakdown["activations"] > 1.9 * est.breakdown["activations"]
    assert bigger.breakdown["params"] == est.breakdown["params"]


def test_tensor_parallel_and_zero3_shrink_per_gpu_memory() -> None:
    base = estimate("llama-2-7b", batch_size=1, seq_len=4096)
    tp = estimate("llama-2-7b", batch_size=1, seq_len=4096, world_size=2, tensor_parallel=2)
    z3 = estimate("llama-2-7b", batch_size=1, seq_len=4096, world_size=8, zero_stage=3)
    assert tp.breakdown["params"] == pytest.approx(base.breakdown["params"] / 2, rel=1e-6)
    assert tp.breakdown["activations"] < base.breakdown["activations"]
    assert z3.breakdown["optimizer"] == pytest.approx(base.breakdown["optimizer"] / 8, rel=1e-6)
    with pytest.raises(ConfigError, match="multiple of tensor_parallel"):
        estimate("llama-2-7b", batch_size=1, seq_len=8, world_size=3, tensor_parallel=2)


def test_flash_attention_removes_quadratic_terms() -> None:
    eager = estimate("gpt2", batch_size=1, seq_len=4096, flash_attention=False)
    flash = estimate("gpt2", batch_size=1, seq_len=4096)
    shape = shape_by_name("gpt2")
    quadratic = shape.layers * 2 * shape.heads * 4096 * 4096  # softmax output, 2 bytes
    lse = shape.layers * 4 * shape.heads * 4096  # FlashAttention's fp32 log-sum-exp
    assert eager.breakdown["activations"] - flash.breakdown["activations"] == quadratic - lse


def test_catalog_param_counts_match_published_models() -> None:
    assert shape_by_name("gpt2").num_params == 124_439_808
    assert shape_by_name("gpt2-medium").num_params == 354_823_168
    assert shape_by_name("llama-2-7b").num_params == 6_738_415_616
    assert shape_by_name("llama-3-8b").num_params == 8_030_261_248
    with pytest.raises(ConfigError, match=r"known: .*gpt2"):
        shape_by_name("gpt5")


def test_shape_from_hf_configs_and_meta_module() -> None:
    import transformers

    gpt2 = shape_from_hf_config(transformers.GPT2Config())
    assert gpt2.num_params == shape_by_name("gpt2").num_params
    llama = shape_from_hf_config(
        transformers.LlamaConfig(
            hidden_size=4096,
            intermediate_size=14336,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=8,
            vocab_size=128256,
        )
    )
    assert (llama.mlp, llama.norm, llama.kv_heads) == ("swiglu", "rmsnorm", 8)
    assert llama.num_params == shape_by_name("llama-3-8b").num_params
    small = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=100, n_positions=64)
    with torch.device("meta"):
        model = transformers.GPT2LMHeadModel(small)
    est = estimate(model, batch_size=2, seq_len=64)
    assert est.num_params == sum(p.numel() for p in model.parameters())
    assert est.method == "traced" and est.shape is not None and est.shape.layers == 2


def test_shape_validation() -> None:
    with pytest.raises(ConfigError, match="divisible"):
        TransformerShape(2, 100, 3, 10)
    with pytest.raises(ConfigError, match="accepted: gelu, swiglu"):
        TransformerShape(2, 64, 4, 10, mlp="relu")
    with pytest.raises(ConfigError, match="TransformerShape"):
        estimate(torch.nn.Linear(2, 2), batch_size=1, seq_len=2)


def test_options_validate_fragmentation() -> None:
    with pytest.raises(ConfigError, match="fragmentation_fraction"):
        EstimateOptions(batch_size=1, seq_len=1, fragmentation_fraction=1.5)


MIXTRAL_8X7B = {
    "model_type": "mixtral",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
    "vocab_size": 32000,
    "rms_norm_eps": 1e-5,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
}


def test_mixtral_config_is_refused_not_read_as_a_dense_7b() -> None:
    """Issue 15: a Mixtral-8x7B config.json was read as a dense 7.24B model (true 46.7B)."""
    with pytest.raises(ConfigError, match=r"mixture of experts.*traces"):
        shape_from_hf_config(MIXTRAL_8X7B)
    with pytest.raises(ConfigError, match="mixture of experts"):
        estimate(MIXTRAL_8X7B, batch_size=1, seq_len=8)


def test_gemma_config_head_dim_is_refused_not_sized_29_percent_low() -> None:
    gemma = {
        "model_type": "gemma",
        "hidden_size": 3072,
        "intermediate_size": 24576,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 16,
        "head_dim": 256,
        "vocab_size": 256000,
        "hidden_act": "gelu_pytorch_tanh",
    }
    with pytest.raises(ConfigError, match="head_dim=256"):
        shape_from_hf_config(gemma)
    gemma_2b = gemma | {"hidden_size": 2048, "num_attention_heads": 8, "head_dim": 256}
    with pytest.raises(ConfigError, match="model_type='gemma'"):  # gated GELU, tied head
        shape_from_hf_config(gemma_2b)


def test_llama_config_without_tie_key_is_untied_like_transformers() -> None:
    llama = {k: v for k, v in MIXTRAL_8X7B.items() if k not in ("num_local_experts",)}
    llama = llama | {"model_type": "llama"}
    del llama["tie_word_embeddings"]  # LlamaConfig's default: untied
    assert not shape_from_hf_config(llama).tied_embeddings


def test_formula_model_terms_foreach_accumulation_and_fp32_logits() -> None:
    """Issue 15: foreach AdamW's temporary, fp32 grads kept by accumulation, fp32 loss."""
    shape = shape_by_name("gpt2")
    psi = shape.num_params
    kw = dict(batch_size=1, seq_len=128)
    foreach = estimate(shape, **kw)
    fused = estimate(shape, optimizer_impl="fused", **kw)
    assert foreach.breakdown["optimizer_temp"] == 4 * psi and fused.breakdown["optimizer_temp"] == 0
    # when the step is the peak: 2 + 4 + 8 + 2 (+ 4 foreach) = 20 bytes/param
    step = foreach.phase_peaks["optimizer"] - 64 * 2**20
    assert step == 20 * psi
    one = estimate(shape, batch_size=4, seq_len=1024)
    two = estimate(shape, batch_size=4, seq_len=1024, grad_accum=2)
    assert two.phase_peaks["forward_backward"] - one.phase_peaks["forward_backward"] == 4 * psi
    bf16 = estimate(shape, batch_size=4, seq_len=1024, precision="bf16")
    assert bf16.breakdown["logits"] == 3 * 4 * 4 * 1024 * shape.vocab  # HF's loss upcasts


def test_formula_lora_8bit_and_offload() -> None:
    shape = shape_by_name("llama-2-7b")
    psi = shape.num_params
    kw = dict(batch_size=1, seq_len=512)
    lora = estimate(shape, trainable_fraction=0.01, **kw)
    assert lora.breakdown["params"] == 2 * psi
    assert lora.breakdown["optimizer"] == pytest.approx(0.01 * 8 * psi, rel=1e-6)
    eight = estimate(shape, optimizer="adamw-8bit", **kw)
    assert eight.breakdown["optimizer"] == pytest.approx(2.03125 * psi, rel=1e-6)
    off = estimate(shape, optimizer_offload=True, **kw)
    assert off.breakdown["optimizer"] == off.breakdown["master_weights"] == 0
    assert off.breakdown["optimizer_temp"] == 0
