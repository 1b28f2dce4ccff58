"""Transformer shapes: the few numbers that decide memory, a catalog by name, and HF configs.

A :class:`TransformerShape` describes a decoder-only transformer: ``layers`` blocks of
attention + MLP over a ``hidden``-wide residual stream. GPT-2 style blocks use LayerNorm,
a GELU MLP of width ``ffn_hidden`` (default ``4*hidden``) and biases; Llama style blocks
(``mlp="swiglu"``, ``norm="rmsnorm"``) use a gated SiLU MLP, grouped-query attention
(``kv_heads``) and rotary positions.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import KW_ONLY, dataclass, fields
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any

from flashckpt.errors import ConfigError

log = logging.getLogger(__name__)

MLP_KINDS = ("gelu", "swiglu")
NORM_KINDS = ("layernorm", "rmsnorm")
POSITION_KINDS = ("learned", "rope")


@dataclass(frozen=True)
class TransformerShape:
    """Shape of a decoder-only transformer (the inputs of :func:`flashckpt.memory.estimate`)."""

    layers: int
    hidden: int
    heads: int
    vocab: int
    ffn_hidden: int | None = None
    kv_heads: int | None = None
    tied_embeddings: bool = True
    _: KW_ONLY
    mlp: str = "gelu"
    norm: str = "layernorm"
    bias: bool = True
    qkv_bias: bool = False
    positions: str = "learned"
    max_seq_len: int = 2048
    name: str = ""

    def __post_init__(self) -> None:
        for key in ("layers", "hidden", "heads", "vocab", "max_seq_len"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"TransformerShape.{key} must be a positive int, got {value!r}")
        if self.hidden % self.heads:
            raise ConfigError(
                f"TransformerShape: hidden={self.hidden} must be divisible by heads={self.heads}"
            )
        if self.heads % self.num_kv_heads:
            raise ConfigError(
                f"TransformerShape: heads={self.heads} must be a multiple of "
                f"kv_heads={self.num_kv_heads}"
            )
        for key, allowed in (
            ("mlp", MLP_KINDS),
            ("norm", NORM_KINDS),
            ("positions", POSITION_KINDS),
        ):
            if getattr(self, key) not in allowed:
                raise ConfigError(
                    f"TransformerShape.{key}={getattr(self, key)!r}; accepted: {', '.join(allowed)}"
                )

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def num_kv_heads(self) -> int:
        return self.kv_heads if self.kv_heads is not None else self.heads

    @property
    def kv_hidden(self) -> int:
        """Width of K (and of V): ``kv_heads * head_dim``."""
        return self.num_kv_heads * self.head_dim

    @property
    def ffn(self) -> int:
        """MLP width: ``ffn_hidden``, else 4h (GELU) or 8h/3 rounded up to 256 (SwiGLU)."""
        if self.ffn_hidden is not None:
            return self.ffn_hidden
        if self.mlp == "gelu":
            return 4 * self.hidden
        return -(-(8 * self.hidden // 3) // 256) * 256

    @property
    def layer_params(self) -> int:
        """Parameters of one block: attention, MLP and its two norms."""
        h, hk, f = self.hidden, self.kv_hidden, self.ffn
        attn = h * (h + 2 * hk) + h * h
        if self.bias:
            attn += (h + 2 * hk) + h
        elif self.qkv_bias:
            attn += h + 2 * hk
        if self.mlp == "gelu":
            mlp = 2 * h * f + ((f + h) if self.bias else 0)
        else:
            mlp = 3 * h * f + ((2 * f + h) if self.bias else 0)
        return attn + mlp + 2 * self._norm_params

    @property
    def embedding_params(self) -> int:
        """Token (and learned position) embeddings, the untied LM head and the final norm."""
        count = self.vocab * self.hidden + self._norm_params
        if self.positions == "learned":
            count += self.max_seq_len * self.hidden
        if not self.tied_embeddings:
            count += self.vocab * self.hidden
        return count

    @property
    def num_params(self) -> int:
        return self.layers * self.layer_params + self.embedding_params

    @property
    def _norm_params(self) -> int:
        return 2 * self.hidden if (self.norm == "layernorm" and self.bias) else self.hidden

    def with_layers(self, layers: int) -> TransformerShape:
        """The same shape with a different depth (e.g. a short block stack for a test)."""
        values = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "_"}
        values["layers"] = layers
        return TransformerShape(**values)


def _from_catalog_entry(name: str, entry: dict[str, Any]) -> TransformerShape:
    entry = dict(entry)
    if entry.pop("arch", "gpt2") == "llama":
        entry.setdefault("mlp", "swiglu")
        entry.setdefault("norm", "rmsnorm")
        entry.setdefault("bias", False)
        entry.setdefault("positions", "rope")
    return TransformerShape(name=name, **entry)


@cache
def _catalog() -> dict[str, dict[str, Any]]:
    text = resources.files("flashckpt.memory").joinpath("models.json").read_text()
    return {k: v for k, v in json.loads(text).items() if not k.startswith("_")}


def known_shapes() -> list[str]:
    """Names accepted by :func:`shape_by_name`."""
    return sorted(_catalog())


def shape_by_name(name: str) -> TransformerShape:
    """A well-known shape: ``gpt2``, ``gpt2-medium``, ``llama-2-7b``, ``llama-3-70b``, ..."""
    key = name.strip().lower().replace("_", "-")
    if key not in _catalog():
        raise ConfigError(f"unknown model {name!r}; known: {', '.join(known_shapes())}")
    return _from_catalog_entry(key, _catalog()[key])


def _pick(cfg: dict[str, Any], *keys: str, default: Any = None) -> Any:
    for key in keys:
        if cfg.get(key) is not None:
            return cfg[key]
    return default


# model_type -> (gated MLP, tied embeddings by default): the dense decoders the formulas size.
_FORMULA_TYPES = {
    "gpt2": (False, True),
    "llama": (True, False),
    "mistral": (True, False),
    "qwen2": (True, False),
}
_MOE_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_intermediate_size")
_TRACED = (
    "build the model instead (on the meta device is enough) and pass it to estimate(), which "
    "traces one real training step; `flashckpt plan` does so when transformers is installed"
)


def _refuse_unsized(cfg: dict[str, Any]) -> None:
    """Refuse configs the formulas would size wrong (MoE, head_dim, unknown architectures)."""
    kind = cfg.get("model_type")
    experts = [k for k in _MOE_KEYS if cfg.get(k) not in (None, 0, 1)]
    if experts:
        raise ConfigError(
            f"model config is a mixture of experts ({experts[0]}={cfg[experts[0]]}); the "
            f"formulas size dense models only: {_TRACED}"
        )
    hidden = _pick(cfg, "hidden_size", "n_embd", "d_model")
    heads = _pick(cfg, "num_attention_heads", "n_head")
    head_dim = cfg.get("head_dim")
    if head_dim is not None and hidden and heads and head_dim * heads != hidden:
        raise ConfigError(
            f"model config has head_dim={head_dim} != hidden {hidden} / heads {heads}; the "
            f"formulas assume head_dim = hidden/heads: {_TRACED}"
        )
    if kind is not None and kind not in _FORMULA_TYPES:
        raise ConfigError(
            f"model_type={kind!r}: the formulas know {', '.join(_FORMULA_TYPES)} (gated MLP, "
            f"norms and tied head as those define them); for any other: {_TRACED}"
        )


def shape_from_hf_config(config: Any) -> TransformerShape:
    """Build a shape from a Hugging Face config (object, dict or path to ``config.json``).

    Reads GPT-2 names (``n_layer``, ``n_embd``, ``n_head``, ``n_inner``) and Llama/Mistral/Qwen
    names (``num_hidden_layers``, ``hidden_size``, ``num_attention_heads``,
    ``num_key_value_heads``, ``intermediate_size``); the ``model_type`` decides the MLP and
    the default for tied embeddings. Refuses (:class:`ConfigError`) what the formulas would size
    wrong: mixtures of experts, ``head_dim != hidden/heads`` and other architectures (Gemma's
    gated GELU, ...) — trace the built model instead.
    """
    if isinstance(config, (str, os.PathLike)):
        try:
            config = json.loads(Path(config).read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ConfigError(f"cannot read model config {config}: {exc}") from exc
    cfg = dict(config) if isinstance(config, dict) else config.to_dict()
    _refuse_unsized(cfg)
    layers = _pick(cfg, "num_hidden_layers", "n_layer", "num_layers")
    hidden = _pick(cfg, "hidden_size", "n_embd", "d_model")
    heads = _pick(cfg, "num_attention_heads", "n_head")
    vocab = _pick(cfg, "vocab_size")
    if None in (layers, hidden, heads, vocab):
        raise ConfigError(
            "model config lacks one of num_hidden_layers/n_layer, hidden_size/n_embd, "
            "num_attention_heads/n_head, vocab_size; pass a TransformerShape instead"
        )
    act = str(_pick(cfg, "hidden_act", "activation_function", default="gelu"))
    kind = str(cfg.get("model_type"))
    gated, tied_default = _FORMULA_TYPES.get(kind, (act in ("silu", "swish"), True))
    learned = "n_positions" in cfg or cfg.get("model_type") in ("gpt2", "opt", "gpt_bigcode")
    return TransformerShape(
        int(layers),
        int(hidden),
        int(heads),
        int(vocab),
        ffn_hidden=_pick(cfg, "intermediate_size", "n_inner", "ffn_dim"),
        kv_heads=_pick(cfg, "num_key_value_heads"),
        tied_embeddings=bool(cfg.get("tie_word_embeddings", tied_default)),
        mlp="swiglu" if gated else "gelu",
        norm="rmsnorm" if "rms_norm_eps" in cfg else "layernorm",
        bias=not gated,
        qkv_bias=bool(cfg.get("attention_bias", False) or cfg.get("model_type") == "qwen2"),
        positions="learned" if learned else "rope",
        max_seq_len=int(_pick(cfg, "n_positions", "max_position_embeddings", default=2048)),
        name=str(cfg.get("_name_or_path") or cfg.get("model_type") or ""),
    )


def resolve_shape(model: Any) -> TransformerShape:
    """A shape from a shape, catalog name, HF config (object/dict/path) or module.config."""
    if isinstance(model, TransformerShape):
        return model
    if isinstance(model, str) and not model.endswith(".json"):
        return shape_by_name(model)
    if isinstance(model, (str, os.PathLike, dict)) or hasattr(model, "to_dict"):
        return shape_from_hf_config(model)
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "to_dict"):
        return shape_from_hf_config(config)
    shape = getattr(model, "flashckpt_shape", None)
    if isinstance(shape, TransformerShape):
        return shape
    raise ConfigError(
        f"cannot infer a transformer shape from {type(model).__name__}; pass a TransformerShape, "
        "a catalog name, an HF config, or set module.flashckpt_shape (or use memory.profile())"
    )
