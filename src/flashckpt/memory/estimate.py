"""Per-GPU memory of a training step: traced for a real model, closed forms for a shape.

:func:`estimate` measures an ``nn.Module`` by running one real training step on fake
tensors (:mod:`flashckpt.memory.trace.measure`) and falls back to the formulas
(:mod:`flashckpt.memory.formula`) for catalog names, ``TransformerShape`` objects and config
numbers; ``MemoryEstimate.method`` says which answered.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from flashckpt.errors import ConfigError
from flashckpt.memory.formula import formula_estimate
from flashckpt.memory.options import (
    ADAFACTOR_BYTES_PER_PARAM,
    ALLOCATOR_WORKSPACE_BYTES,
    BREAKDOWN_KEYS,
    CUDA_CONTEXT_BYTES,
    OPTIMIZER_IMPLS,
    OPTIMIZERS,
    PRECISIONS,
    EstimateOptions,
    MemoryEstimate,
    model_state_breakdown,
    model_state_bytes,
    recomputed_layers,
)
from flashckpt.memory.shapes import TransformerShape, resolve_shape
from flashckpt.memory.trace.measure import trace_model, traced_estimate

log = logging.getLogger(__name__)

METHODS = ("auto", "traced", "formula")

__all__ = [
    "ADAFACTOR_BYTES_PER_PARAM",
    "ALLOCATOR_WORKSPACE_BYTES",
    "BREAKDOWN_KEYS",
    "CUDA_CONTEXT_BYTES",
    "METHODS",
    "OPTIMIZERS",
    "OPTIMIZER_IMPLS",
    "PRECISIONS",
    "EstimateOptions",
    "MemoryEstimate",
    "estimate",
    "model_state_breakdown",
    "model_state_bytes",
    "recomputed_layers",
]


def _layer_params(model: nn.Module) -> int:
    from flashckpt.memory.recompute.profile import find_blocks

    try:
        names = find_blocks(model)
    except ConfigError:
        return 0
    modules = dict(model.named_modules())
    return max(sum(p.numel() for p in modules[n].parameters()) for n in names)


def _shape_or_none(model: nn.Module) -> TransformerShape | None:
    try:
        return resolve_shape(model)
    except ConfigError:  # MoE, odd head_dim, not a transformer: the trace needs no shape
        return None


def estimate(
    model_or_shape: Any,
    *,
    method: str = "auto",
    inputs: Callable[[int, int, torch.device], dict[str, Any]] | None = None,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    device: str | None = None,
    **options: Any,
) -> MemoryEstimate:
    """Estimate per-GPU bytes of a training step; keyword options as in :class:`EstimateOptions`.

    ``model_or_shape``: an ``nn.Module`` (on any device, ``meta`` included) is *traced*: one
    real training step runs on fake tensors (``inputs``/``loss_fn`` for a module that is not a
    Hugging Face causal LM; ``device`` the fake device, default CUDA where available). A
    :class:`TransformerShape`, a catalog name (``"llama-3-8b"``) or a Hugging Face config
    (object, dict or ``config.json`` path) uses the formulas. ``method="formula"`` forces the
    formulas for a module with a ``.config`` or ``flashckpt_shape``.
    """
    if method not in METHODS:
        raise ConfigError(f"method={method!r}; accepted: {', '.join(METHODS)}")
    opts = EstimateOptions(**options)
    is_module = isinstance(model_or_shape, nn.Module)
    if is_module and method != "formula":
        hf = isinstance(getattr(getattr(model_or_shape, "config", None), "vocab_size", None), int)
        if method == "traced" or inputs is not None or hf:
            traced = trace_model(
                model_or_shape, opts, inputs=inputs, loss_fn=loss_fn, device=device
            )
            est = traced_estimate(traced, opts, layer_params=_layer_params(model_or_shape))
            return dataclasses.replace(est, shape=_shape_or_none(model_or_shape))
    elif method == "traced":
        raise ConfigError(
            f"method='traced' needs an nn.Module, got {type(model_or_shape).__name__}; build "
            "the model (on the meta device is enough) or use flashckpt.memory.build_hf_model"
        )
    shape = resolve_shape(model_or_shape)
    num_params = (
        sum(p.numel() for p in model_or_shape.parameters()) if is_module else shape.num_params
    )
    return formula_estimate(shape, num_params, opts)
