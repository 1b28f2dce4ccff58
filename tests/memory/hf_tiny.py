"""Tiny Hugging Face models for tests/memory: GPT-2, Llama (GQA), Mixtral (MoE), Gemma."""

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
    max_position_embeddings=64,
)


def config(name: str, **overrides: Any) -> Any:
    """A tiny config: ``gpt2`` (gelu_new, dropout 0.1), ``llama``, ``mixtral``, ``gemma``."""
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
    if name == "gemma":  # head_dim 32 != hidden 64 / heads 4
        return transformers.GemmaConfig(**(_LLAMA | dict(head_dim=32) | overrides))
    raise ValueError(name)


def model(name: str, **overrides: Any) -> torch.nn.Module:
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config(name, **overrides))
