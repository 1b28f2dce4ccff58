"""Hugging Face models from configs only (no network, no weights): for the traced estimate.

:func:`hf_config` reads a ``config.json`` (or a dict) with the config class of its
``model_type``, or turns a catalog name into the config of the model it names (GPT-2 family,
Llama, Mistral, Qwen2); :func:`build_hf_model` builds the causal LM on the ``meta`` device,
which takes no memory and is what :func:`flashckpt.memory.estimate` traces.
"""

from __future__ import annotations

import copy
import json
import logging
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from flashckpt.errors import ConfigError
from flashckpt.memory.shapes import TransformerShape, shape_by_name

log = logging.getLogger(__name__)

_DROPOUT_FIELDS = ("resid_pdrop", "embd_pdrop", "attn_pdrop", "attention_dropout", "hidden_dropout")


def transformers_available() -> bool:
    try:
        import transformers  # noqa: F401
    except ImportError:
        return False
    return True


def _catalog_config(shape: TransformerShape) -> Any:
    import transformers

    if shape.positions == "learned":
        return transformers.GPT2Config(
            n_layer=shape.layers,
            n_embd=shape.hidden,
            n_head=shape.heads,
            vocab_size=shape.vocab,
            n_positions=shape.max_seq_len,
            n_inner=shape.ffn_hidden,
        )
    common: dict[str, Any] = dict(
        hidden_size=shape.hidden,
        intermediate_size=shape.ffn,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.num_kv_heads,
        vocab_size=shape.vocab,
        tie_word_embeddings=shape.tied_embeddings,
        max_position_embeddings=shape.max_seq_len,
    )
    if shape.name.startswith("mistral"):
        return transformers.MistralConfig(**common)
    if shape.name.startswith("qwen2"):
        return transformers.Qwen2Config(**common)
    return transformers.LlamaConfig(**common)


def hf_config(model: Any) -> Any:
    """The HF config for a catalog name, a ``config.json`` path or a dict (needs transformers)."""
    import transformers

    if isinstance(model, str) and not model.endswith(".json"):
        return _catalog_config(shape_by_name(model))
    if isinstance(model, (str, os.PathLike)):
        try:
            model = json.loads(Path(model).read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ConfigError(f"cannot read model config {model}: {exc}") from exc
    if not isinstance(model, dict):
        return model  # already a config object
    kind = str(model.get("model_type"))
    if kind not in transformers.CONFIG_MAPPING:
        raise ConfigError(
            f"config model_type={kind!r} is not one transformers knows; pass a catalog name"
        )
    values = {k: v for k, v in model.items() if k != "model_type"}
    return transformers.CONFIG_MAPPING[kind](**values)


def build_hf_model(config: Any, *, dropout: bool | None = None) -> nn.Module:
    """The causal LM of ``config`` on the meta device; ``dropout`` True/False sets 0.1/0.0."""
    import transformers

    if dropout is not None:
        config = copy.deepcopy(config)
        for name in _DROPOUT_FIELDS:
            if hasattr(config, name):
                setattr(config, name, 0.1 if dropout else 0.0)
    try:
        with torch.device("meta"):
            return transformers.AutoModelForCausalLM.from_config(config)
    except (ValueError, KeyError) as exc:
        raise ConfigError(f"transformers cannot build a causal LM from this config: {exc}") from exc
