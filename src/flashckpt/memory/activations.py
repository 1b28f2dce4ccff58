"""Activation memory of a transformer layer, tensor by tensor.

Source: Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
Models" (arXiv:2205.05198), section 4. With 16-bit activations, 1-byte dropout masks, no
parallelism and no FlashAttention, one GPT layer saves ``s*b*h*(34 + 5*a*s/h)`` bytes:

* attention ``11*s*b*h + 5*a*s^2*b``: QKV input 2sbh, Q and K 4sbh, softmax output 2as²b,
  attention dropout mask as²b and output 2as²b, V 2sbh, output projection input 2sbh,
  dropout mask sbh;
* MLP ``19*s*b*h``: first linear input 2sbh, GELU input 8sbh, second linear input 8sbh,
  dropout mask sbh;
* two LayerNorm inputs ``4*s*b*h``.

Tensor parallelism (degree t) splits everything between the column- and row-parallel linears
(``24*s*b*h/t + 5*a*s^2*b/t``); sequence parallelism also splits the remaining ``10*s*b*h``
(section 4.2.2). Selective recompute drops the ``5*a*s^2*b`` attention-core terms (section 5);
full recompute keeps only each layer's input, ``2*s*b*h`` (section 5).

This module generalises the inventory to grouped-query attention (K and V are
``kv_heads*head_dim`` wide), SwiGLU MLPs (gate output, SiLU output, up output and the product:
``8*s*b*f`` bytes), FlashAttention (no ``s^2`` terms; the kernel saves a
float32 log-sum-exp per head and token, Dao et al. 2022; the kernel's output, laid out as
(b, s, heads, d), is the output projection's input, so it is not counted twice), rotary
cos/sin tables (``4*s*d`` elements when built per layer), norm statistics (float32 per
token) and an fp32 residual stream (PyTorch autocast keeps residual adds and norm inputs in
fp32).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from flashckpt.memory.shapes import TransformerShape

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class ActivationOptions:
    """How activations are stored: dtype widths, attention kernel, parallelism, dropout."""

    act_bytes: int = 2
    residual_bytes: int = 2
    flash_attention: bool = True
    dropout: bool = False
    tensor_parallel: int = 1
    sequence_parallel: bool = False
    selective_recompute: bool = False


def layer_activation_bytes(
    shape: TransformerShape, *, batch_size: int, seq_len: int, opts: ActivationOptions
) -> int:
    """Bytes one layer saves for backward (Korthikanti et al. 2022, section 4, generalised)."""
    s, b, h = seq_len, batch_size, shape.hidden
    n = s * b
    a, hk, f = shape.heads, shape.kv_hidden, shape.ffn
    act, res, t = opts.act_bytes, opts.residual_bytes, opts.tensor_parallel
    norm_stats = (8 if shape.norm == "layernorm" else 4) * n
    # Replicated region: norms' inputs (+stats), QKV and MLP linear inputs, residual dropout masks.
    replicated = 2 * (res * n * h + norm_stats) + 2 * act * n * h
    if opts.dropout:
        replicated += 2 * n * h
    # Tensor-parallel region: Q, K, V, attention core, output-projection input, MLP internals.
    parallel = act * n * (h + 2 * hk) + act * n * h
    parallel += (2 if shape.mlp == "gelu" else 4) * act * n * f
    if shape.positions == "rope":
        parallel += 4 * act * s * shape.head_dim  # cos and sin, saved by the Q and K rotations
    if opts.flash_attention:
        parallel += 4 * n * a  # fp32 log-sum-exp; the saved output is the out-projection input
    elif not opts.selective_recompute:
        scores = a * s * s * b
        parallel += act * scores + ((1 + act) * scores if opts.dropout else 0)
    if opts.sequence_parallel:
        replicated //= t
    return replicated + parallel // t


def layer_input_bytes(
    shape: TransformerShape, *, batch_size: int, seq_len: int, opts: ActivationOptions
) -> int:
    """Bytes a fully recomputed layer keeps: its input, ``2*s*b*h`` in 16 bits (section 5)."""
    size = opts.residual_bytes * seq_len * batch_size * shape.hidden
    return size // opts.tensor_parallel if opts.sequence_parallel else size


def outer_activation_bytes(
    shape: TransformerShape, *, batch_size: int, seq_len: int, opts: ActivationOptions
) -> int:
    """Activations outside the layers: token ids, final norm input and stats, LM-head input."""
    n = seq_len * batch_size
    stats = (8 if shape.norm == "layernorm" else 4) * n
    size = (
        8 * n + opts.residual_bytes * n * shape.hidden + stats + opts.act_bytes * n * shape.hidden
    )
    if opts.dropout:
        size += n * shape.hidden
    return size


def logits_bytes(
    shape: TransformerShape, *, batch_size: int, seq_len: int, loss_bytes: int, tensor_parallel: int
) -> int:
    """Peak bytes of the LM head output and cross-entropy (``3 * s*b*V * loss_bytes``).

    At the start of backward three ``s*b*V`` tensors in the loss dtype are live: the
    log-softmax output saved for backward, the gradient flowing into it from the NLL loss and
    the gradient it produces. Megatron-style vocab-parallel heads split them over ``t``.
    """
    return 3 * loss_bytes * seq_len * batch_size * shape.vocab // tensor_parallel
