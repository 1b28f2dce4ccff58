"""The closed-form estimate for a shape (catalog name, ``TransformerShape``, config numbers).

Model states: :func:`flashckpt.memory.options.model_state_breakdown` (ZeRO paper);
activations: :mod:`flashckpt.memory.activations` (Korthikanti et al. 2022, generalised). On
top of the papers, the terms PyTorch training adds:

* PyTorch's default foreach AdamW computes ``sqrt(v)`` for every parameter at once: one
  state-sized temporary (4 bytes/param under mixed precision) during the optimizer step
  (``optimizer_temp``); the for-loop implementation holds one parameter's worth, fused none.
* With ``grad_accum > 1`` the gradients (fp32 under autocast) stay alive through the next
  micro-batch's forward and backward.
* Hugging Face's causal-LM loss upcasts the logits to fp32 (``logits.float()``), so the loss
  costs fp32 logits in every precision, pure bf16 included.

A shape is a dense decoder; configs the shape cannot describe (MoE, a head_dim that is not
hidden/heads) are refused when the shape is read (:mod:`flashckpt.memory.shapes`).
"""

from __future__ import annotations

import logging
import math

from flashckpt.memory import activations as act
from flashckpt.memory.allocator.blocks import ROUND_LARGE, pool_slack
from flashckpt.memory.options import (
    _PRECISION_BYTES,
    ALLOCATOR_WORKSPACE_BYTES,
    BREAKDOWN_KEYS,
    CUDA_CONTEXT_BYTES,
    EstimateOptions,
    MemoryEstimate,
    model_state_breakdown,
    recomputed_layers,
)
from flashckpt.memory.shapes import TransformerShape

log = logging.getLogger(__name__)

LOSS_BYTES = 4  # HF's loss upcasts logits to fp32 (and PyTorch autocast runs the loss in fp32)


def optimizer_temp_bytes(shape: TransformerShape, num_params: int, opts: EstimateOptions) -> int:
    """Bytes of the optimizer step's temporaries per GPU (see the module docstring)."""
    if opts.optimizer not in ("adam", "adamw") or opts.optimizer_offload:
        return 0
    moment_b = _PRECISION_BYTES[opts.precision][3]
    if opts.optimizer_impl == "fused":
        return 0
    local = num_params * opts.trainable_fraction / opts.tensor_parallel
    if opts.optimizer_impl == "for-loop":
        local = min(local, shape.vocab * shape.hidden / opts.tensor_parallel)  # largest tensor
    elif opts.zero_stage >= 1:
        local /= opts.world_size // opts.tensor_parallel
    return math.ceil(moment_b * local)


def _accumulated_grad_bytes(num_params: int, opts: EstimateOptions) -> int:
    if opts.grad_accum == 1:
        return 0
    grad_b = 4 if opts.precision != "bf16" else 2  # fp32 gradients under autocast and fp32
    local = num_params * opts.trainable_fraction / opts.tensor_parallel
    if opts.zero_stage >= 2:
        local /= opts.world_size // opts.tensor_parallel
    return math.ceil(grad_b * local)


def formula_estimate(
    shape: TransformerShape, num_params: int, opts: EstimateOptions
) -> MemoryEstimate:
    """Per-GPU bytes of a training step of ``shape`` from the closed forms."""
    states = model_state_breakdown(
        num_params,
        optimizer=opts.optimizer,
        precision=opts.precision,
        zero_stage=opts.zero_stage,
        world_size=opts.world_size,
        tensor_parallel=opts.tensor_parallel,
        trainable_fraction=opts.trainable_fraction,
        optimizer_offload=opts.optimizer_offload,
    )
    a_opts = opts.activation_options()
    dims = {"batch_size": opts.batch_size, "seq_len": opts.seq_len}
    per_layer = act.layer_activation_bytes(shape, opts=a_opts, **dims)
    per_input = act.layer_input_bytes(shape, opts=a_opts, **dims)
    k = recomputed_layers(opts.recompute, shape.layers)
    activations = (shape.layers - k) * per_layer + k * per_input + (per_layer if k else 0)
    activations += act.outer_activation_bytes(shape, opts=a_opts, **dims)
    logits = act.logits_bytes(
        shape, loss_bytes=LOSS_BYTES, tensor_parallel=opts.tensor_parallel, **dims
    )
    workspace = ALLOCATOR_WORKSPACE_BYTES
    if opts.zero_stage == 3 and opts.world_size > opts.tensor_parallel:
        # FSDP/ZeRO-3 gathers one layer's 16-bit parameters and prefetches the next.
        workspace += 2 * _PRECISION_BYTES[opts.precision][0] * shape.layer_params
    temp = optimizer_temp_bytes(shape, num_params, opts)
    static = states["params"] + states["master_weights"] + states["optimizer"]
    # A recomputed layer's activations are live during backward, after the logits are freed.
    live = per_layer if k else 0
    forward_backward = max(activations - live + logits, activations)
    forward_backward += _accumulated_grad_bytes(num_params, opts)
    step = states["grads"] + temp
    allocated = workspace + static + max(forward_backward, step)
    breakdown = dict(states)
    breakdown |= {"activations": activations, "logits": logits, "optimizer_temp": temp}
    breakdown["workspace"] = workspace + CUDA_CONTEXT_BYTES
    breakdown["fragmentation_margin"] = _margin(opts, allocated)
    breakdown = {key: breakdown[key] for key in BREAKDOWN_KEYS}
    return MemoryEstimate(
        shape=shape,
        num_params=num_params,
        options=opts,
        breakdown=breakdown,
        allocated_peak_bytes=allocated,
        method="formula",
        phase_peaks={
            "forward_backward": workspace + static + forward_backward,
            "optimizer": workspace + static + step,
        },
    )


def _margin(opts: EstimateOptions, allocated: int) -> int:
    """The fragmentation margin of a closed-form estimate: ``fragmentation_fraction`` of the
    peak when set, else the allocator's rules (memory/allocator/blocks.py) for tensors the
    formula does not list one by one: the pools' partly empty segments, and without expandable
    segments the 2 MiB rounding of each large block, about 1 MiB per 200 MiB held (large
    blocks of a transformer step are tens to hundreds of MiB)."""
    if opts.fragmentation_fraction is not None:
        return math.ceil(opts.fragmentation_fraction * allocated)
    slack = pool_slack(expandable=opts.expandable_segments)
    if opts.expandable_segments:
        return slack
    return slack + math.ceil(allocated / (100 * ROUND_LARGE)) * ROUND_LARGE // 2
