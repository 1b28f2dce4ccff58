"""CUDA's memory-relevant choices, on CPU fake tensors: for planning GPUs without one.

A CPU-only PyTorch cannot build fake CUDA tensors through autograd, and CPU runs differ from
CUDA in two ways that change memory: which attention kernel ``scaled_dot_product_attention``
picks (CUDA runs a fused kernel — FlashAttention or memory-efficient — that saves only the
output and a log-sum-exp, with or without dropout or a mask; on CPU a dropout or mask falls
back to the math path, which saves the ``s x s`` scores), and which ops autocast runs in fp32
(CUDA's autocast upcasts ``pow``, ``exp``, ``rsqrt``, ``softmax``, ``log_softmax``,
``layer_norm``, ``sum`` and their kin; CPU's does not). :class:`CudaRules` applies both on
top of a CPU trace. Kernel-internal workspaces are not modelled (the estimate adds a constant).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map

log = logging.getLogger(__name__)

_LOW = (torch.bfloat16, torch.float16)
T = torch.Tensor
# Ops on CUDA autocast's fp32 lists (aten/src/ATen/autocast_mode.cpp) a transformer uses.
FP32_FUNCS = frozenset(
    {
        torch.pow,
        T.pow,
        T.__pow__,
        torch.exp,
        T.exp,
        torch.log,
        T.log,
        torch.log1p,
        T.log1p,
        torch.rsqrt,
        T.rsqrt,
        torch.reciprocal,
        T.reciprocal,
        torch.expm1,
        torch.erfinv,
        torch.acos,
        torch.asin,
        torch.cosh,
        torch.sinh,
        torch.tan,
        T.tan,
        F.layer_norm,
        F.group_norm,
        torch.layer_norm,
        torch.group_norm,
        F.softplus,
        F.softmax,
        torch.softmax,
        T.softmax,
        F.log_softmax,
        torch.log_softmax,
        T.log_softmax,
        torch.sum,
        T.sum,
        torch.prod,
        T.prod,
        torch.cumsum,
        T.cumsum,
        torch.cumprod,
        torch.logsumexp,
        T.logsumexp,
        torch.norm,
        T.norm,
        torch.linalg.vector_norm,
        F.cosine_similarity,
        F.nll_loss,
        F.kl_div,
        F.l1_loss,
        F.smooth_l1_loss,
        F.huber_loss,
        F.binary_cross_entropy_with_logits,
        torch.dist,
        torch.cdist,
        torch.renorm,
    }
)


def _up(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.dtype in _LOW:
        return value.float()
    return value


def fused_sdpa(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """Attention through a fused kernel: saves output + log-sum-exp (CUDA's choice).

    Dropout inside a fused kernel keeps only an RNG seed, so it is dropped here (same memory).
    """
    if torch.is_autocast_enabled("cpu"):
        dtype = torch.get_autocast_dtype("cpu")
        query, key, value = (t.to(dtype) for t in (query, key, value))
    if enable_gqa and key.shape[-3] != query.shape[-3]:
        groups = query.shape[-3] // key.shape[-3]
        key = key.repeat_interleave(groups, dim=-3)
        value = value.repeat_interleave(groups, dim=-3)
    if attn_mask is not None and attn_mask.dtype != torch.bool:
        attn_mask = attn_mask.to(query.dtype)
    with torch.autocast("cpu", enabled=False):
        out = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            query, key, value, 0.0, is_causal, attn_mask=attn_mask, scale=scale
        )
    return out[0]


class CudaRules(TorchFunctionMode):
    """Run a CPU step with CUDA's attention kernel choice and autocast fp32 list (see above)."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            return fused_sdpa(*args, **kwargs)
        if func in FP32_FUNCS and torch.is_autocast_enabled("cpu"):
            args, kwargs = tree_map(_up, (args, kwargs))
        return func(*args, **kwargs)
