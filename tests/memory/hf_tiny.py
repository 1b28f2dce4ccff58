"""Tiny Hugging Face models for tests/memory: GPT-2, Llama (GQA), MoE families, Gemma."""

from __future__ import annotations

from typing import Any

import torch
import transformers

_LLAMA = dict(
    vocab_size=97,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)


def config(name: str, **overrides: Any) -> Any:
    """A tiny config: ``gpt2`` (gelu_new, dropout 0.1), ``llama``, ``gemma``, and the MoE
    families ``mixtral`` (batched_mm), ``qwen2-moe``, ``olmoe``, ``deepseek-v2`` (their default
    expert kernel, grouped_mm)."""
    if name == "gpt2":
        values = dict(n_layer=2, n_embd=64, n_head=4, vocab_size=97, n_positions=64)
        return transformers.GPT2Config(**(values | overrides))
    if name == "llama":
        return transformers.LlamaConfig(**(_LLAMA | overrides))
    if name == "mixtral":
        values = _LLAMA | dict(
            num_local_experts=4, num_experts_per_tok=2, experts_implementation="batched_mm"
        )
        return transformers.MixtralConfig(**(values | overrides))
    if name == "qwen2-moe":  # transformers' default expert kernel (grouped_mm), shared expert
        values = _LLAMA | dict(
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=64,
        )
        return transformers.Qwen2MoeConfig(**(values | overrides))
    if name == "olmoe":
        values = _LLAMA | dict(num_experts=4, num_experts_per_tok=2)
        return transformers.OlmoeConfig(**(values | overrides))
    if name == "deepseek-v2":  # MLA attention, one dense layer then MoE with a shared expert
        values = _LLAMA | dict(
            moe_intermediate_size=32,
            n_routed_experts=4,
            num_experts_per_tok=2,
            n_shared_experts=1,
            first_k_dense_replace=1,
            kv_lora_rank=16,
            q_lora_rank=None,
            qk_rope_head_dim=8,
            qk_nope_head_dim=8,
            v_head_dim=16,
            n_group=1,
            topk_group=1,
        )
        return transformers.DeepseekV2Config(**(values | overrides))
    if name == "gemma":  # head_dim 32 != hidden 64 / heads 4
        return transformers.GemmaConfig(**(_LLAMA | dict(head_dim=32) | overrides))
    raise ValueError(name)


def model(name: str, **overrides: Any) -> torch.nn.Module:
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config(name, **overrides))
