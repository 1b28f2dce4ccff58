"""Per-GPU memory of a training step, from formulas: model states, activations, logits, slack.

Model states follow the ZeRO paper (Rajbhandari et al. 2020, "ZeRO: Memory Optimizations
Toward Training Trillion Parameter Models", section 3.1): mixed-precision Adam keeps 2 bytes of
16-bit parameters, 2 of 16-bit gradients and 12 of fp32 optimizer state (master weights,
momentum, variance) per parameter, ``16*Psi`` in all; stage 1 shards the 12 over ``N`` ranks
(``4*Psi + 12*Psi/N``), stage 2 also the gradients (``2*Psi + 14*Psi/N``) and stage 3 also the
parameters (``16*Psi/N``; FSDP full sharding). Activations: :mod:`flashckpt.memory.activations`
(Korthikanti et al. 2022).

PyTorch autocast ("bf16-mixed" in Lightning) keeps fp32 parameters and gradients and caches
16-bit weight copies for the step; its peaks equal the ZeRO accounting: ``2+4+8`` bytes/param
during forward/backward (copies + fp32 weights + Adam) and ``4+4+8`` at the optimizer step.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from flashckpt.errors import ConfigError
from flashckpt.memory import activations as act
from flashckpt.memory.shapes import TransformerShape, resolve_shape
from flashckpt.memory.units import MIB, format_bytes

log = logging.getLogger(__name__)

PRECISIONS = ("fp32", "bf16-mixed", "fp16-mixed", "bf16")
OPTIMIZERS = ("adam", "adamw", "sgd", "sgd-momentum", "adafactor")
BREAKDOWN_KEYS = (
    "params",
    "grads",
    "optimizer",
    "master_weights",
    "activations",
    "logits",
    "workspace",
    "fragmentation_margin",
)
# (parameter bytes, gradient bytes, master-weight bytes, bytes per optimizer moment)
_PRECISION_BYTES = {
    "fp32": (4, 4, 0, 4),
    "bf16-mixed": (2, 2, 4, 4),
    "fp16-mixed": (2, 2, 4, 4),
    "bf16": (2, 2, 0, 2),
}
_MOMENTS = {"adam": 2, "adamw": 2, "sgd": 0, "sgd-momentum": 1}
# Adafactor (Shazeer & Stern 2018) without momentum keeps factored second moments, O(r+c) per
# r x c matrix (~0.002 bytes/param at width 4096) and full ones for vectors (4 bytes/param, under
# 1% of a transformer's parameters). 1 byte/param bounds both while vectors stay under 25%.
ADAFACTOR_BYTES_PER_PARAM = 1
CUDA_CONTEXT_BYTES = 512 * MIB  # CUDA context + kernels; outside PyTorch's allocator
ALLOCATOR_WORKSPACE_BYTES = 64 * MIB  # cuBLAS/cuDNN workspaces, small temporaries


def _check_choice(name: str, value: str, allowed: Sequence[str]) -> None:
    if value not in allowed:
        raise ConfigError(f"{name}={value!r} is not supported; accepted: {', '.join(allowed)}")


def _check_parallel(zero_stage: int, world_size: int, tensor_parallel: int = 1) -> None:
    if zero_stage not in (0, 1, 2, 3):
        raise ConfigError(f"zero_stage={zero_stage!r}; accepted: 0, 1, 2, 3 (FSDP full shard = 3)")
    if world_size < 1 or tensor_parallel < 1:
        raise ConfigError(
            f"world_size={world_size} and tensor_parallel={tensor_parallel} must be >= 1"
        )
    if world_size % tensor_parallel:
        raise ConfigError(
            f"world_size={world_size} must be a multiple of tensor_parallel={tensor_parallel}"
        )


def model_state_breakdown(
    num_params: int,
    *,
    optimizer: str = "adamw",
    precision: str = "bf16-mixed",
    zero_stage: int = 0,
    world_size: int = 1,
    tensor_parallel: int = 1,
) -> dict[str, int]:
    """Per-GPU bytes of ``params``, ``grads``, ``optimizer`` and ``master_weights`` (ZeRO paper).

    ``world_size`` counts all GPUs; ZeRO shards over the data-parallel ``world_size /
    tensor_parallel`` ranks, tensor parallelism splits every state ``tensor_parallel`` ways.
    """
    _check_choice("precision", precision, PRECISIONS)
    _check_choice("optimizer", optimizer, OPTIMIZERS)
    _check_parallel(zero_stage, world_size, tensor_parallel)
    if num_params < 0:
        raise ConfigError(f"num_params must be >= 0, got {num_params}")
    p_b, g_b, m_b, moment_b = _PRECISION_BYTES[precision]
    if optimizer == "adafactor":
        opt_b = ADAFACTOR_BYTES_PER_PARAM
    else:
        opt_b = _MOMENTS[optimizer] * moment_b
    local = math.ceil(num_params / tensor_parallel)
    dp = world_size // tensor_parallel

    def per_gpu(bytes_per_param: int, sharded: bool) -> int:
        total = local * bytes_per_param
        return math.ceil(total / dp) if sharded else total

    return {
        "params": per_gpu(p_b, zero_stage >= 3),
        "grads": per_gpu(g_b, zero_stage >= 2),
        "optimizer": per_gpu(opt_b, zero_stage >= 1),
        "master_weights": per_gpu(m_b, zero_stage >= 1),
    }


def model_state_bytes(
    num_params: int,
    *,
    optimizer: str = "adamw",
    precision: str = "bf16-mixed",
    zero_stage: int = 0,
    world_size: int = 1,
) -> int:
    """Parameters + gradients + optimizer state + fp32 master weights per GPU, in bytes.

    Rajbhandari et al. 2020 (ZeRO), section 3.1: mixed-precision Adam needs ``2+2+12 = 16``
    bytes per parameter; ZeRO-1 ``4*Psi + 12*Psi/N``, ZeRO-2 ``2*Psi + 14*Psi/N``, ZeRO-3
    ``16*Psi/N``. fp32 Adam: ``4+4+8``; pure bf16 Adam: ``2+2+4``; SGD keeps no state,
    SGD with momentum one moment.
    """
    parts = model_state_breakdown(
        num_params,
        optimizer=optimizer,
        precision=precision,
        zero_stage=zero_stage,
        world_size=world_size,
    )
    return sum(parts.values())


@dataclass(frozen=True, kw_only=True)
class EstimateOptions:
    """Everything besides the model that decides per-GPU memory; validated on construction."""

    batch_size: int
    seq_len: int
    precision: str = "bf16-mixed"
    optimizer: str = "adamw"
    zero_stage: int = 0
    world_size: int = 1
    tensor_parallel: int = 1
    sequence_parallel: bool = False
    flash_attention: bool = True
    recompute: Any = None
    dropout: bool = False
    residual_fp32: bool | None = None
    fragmentation_fraction: float = 0.05

    def __post_init__(self) -> None:
        if self.batch_size < 1 or self.seq_len < 1:
            raise ConfigError(
                f"batch_size={self.batch_size} and seq_len={self.seq_len} must be >= 1"
            )
        _check_choice("precision", self.precision, PRECISIONS)
        _check_choice("optimizer", self.optimizer, OPTIMIZERS)
        _check_parallel(self.zero_stage, self.world_size, self.tensor_parallel)
        if not 0 <= self.fragmentation_fraction < 1:
            raise ConfigError("fragmentation_fraction must be in [0, 1), e.g. 0.05")

    def activation_options(self) -> act.ActivationOptions:
        residual_fp32 = self.residual_fp32
        if residual_fp32 is None:
            residual_fp32 = self.precision.endswith("-mixed")
        width = 4 if self.precision == "fp32" else 2
        return act.ActivationOptions(
            act_bytes=width,
            residual_bytes=4 if residual_fp32 else width,
            flash_attention=self.flash_attention,
            dropout=self.dropout,
            tensor_parallel=self.tensor_parallel,
            sequence_parallel=self.sequence_parallel,
            selective_recompute=self.recompute == "selective",
        )


def recomputed_layers(recompute: Any, layers: int) -> int:
    """How many layers are fully recomputed for ``recompute`` (None/"selective"/"full"/int/plan)."""
    if recompute is None or recompute in ("none", "selective"):
        return 0
    if recompute == "full":
        return layers
    if isinstance(recompute, int) and not isinstance(recompute, bool):
        count = recompute
    elif hasattr(recompute, "recompute"):
        count = len(recompute.recompute)
    elif isinstance(recompute, Sequence) and not isinstance(recompute, str):
        count = len(recompute)
    else:
        raise ConfigError(
            f"recompute={recompute!r}; accepted: None, 'selective', 'full', a number of layers, "
            "a list of block names or a RecomputePlan"
        )
    if not 0 <= count <= layers:
        raise ConfigError(f"recompute names {count} layers but the model has {layers}")
    return count


@dataclass(frozen=True, kw_only=True)
class MemoryEstimate:
    """Per-GPU memory of one training step.

    ``breakdown`` holds each part at its own maximum; ``total_bytes`` is their sum, an upper
    bound. ``peak_bytes`` is phase-aware: gradients (freed with ``zero_grad(set_to_none=True)``)
    and activations are never both at full size, so the peak is the larger of forward/backward
    (states + activations + logits) and the optimizer step (states + gradients), plus the CUDA
    context and the fragmentation margin. ``allocated_peak_bytes`` leaves out those two and is
    what ``torch.cuda.max_memory_allocated`` measures.
    """

    shape: TransformerShape
    num_params: int
    options: EstimateOptions
    breakdown: dict[str, int] = field(default_factory=dict)
    allocated_peak_bytes: int
    context_bytes: int = CUDA_CONTEXT_BYTES

    @property
    def total_bytes(self) -> int:
        return sum(self.breakdown.values())

    @property
    def peak_bytes(self) -> int:
        return (
            self.allocated_peak_bytes + self.context_bytes + self.breakdown["fragmentation_margin"]
        )

    def fits(self, memory_bytes: int) -> bool:
        """Whether the phase-aware peak fits in ``memory_bytes`` (a GPU's total memory)."""
        return self.peak_bytes <= memory_bytes

    def summary(self) -> str:
        rows = [f"  {key:<22}{format_bytes(value):>12}" for key, value in self.breakdown.items()]
        rows.append(f"  {'peak (phase-aware)':<22}{format_bytes(self.peak_bytes):>12}")
        rows.append(f"  {'sum of parts':<22}{format_bytes(self.total_bytes):>12}")
        return "\n".join(rows)


def _shape_and_params(model_or_shape: Any) -> tuple[TransformerShape, int]:
    params = getattr(model_or_shape, "parameters", None)
    shape = resolve_shape(model_or_shape)
    if callable(params):
        return shape, sum(p.numel() for p in params())
    return shape, shape.num_params


def estimate(model_or_shape: Any, **options: Any) -> MemoryEstimate:
    """Estimate per-GPU bytes of a training step; keyword options as in :class:`EstimateOptions`.

    ``model_or_shape``: a :class:`TransformerShape`, a catalog name (``"llama-3-8b"``), a Hugging
    Face config (object, dict or ``config.json`` path) or an ``nn.Module`` (also on ``meta``)
    with a ``.config`` or a ``flashckpt_shape`` attribute; a module's own parameter count is used.
    """
    opts = EstimateOptions(**options)
    shape, num_params = _shape_and_params(model_or_shape)
    states = model_state_breakdown(
        num_params,
        optimizer=opts.optimizer,
        precision=opts.precision,
        zero_stage=opts.zero_stage,
        world_size=opts.world_size,
        tensor_parallel=opts.tensor_parallel,
    )
    a_opts = opts.activation_options()
    dims = {"batch_size": opts.batch_size, "seq_len": opts.seq_len}
    per_layer = act.layer_activation_bytes(shape, opts=a_opts, **dims)
    per_input = act.layer_input_bytes(shape, opts=a_opts, **dims)
    k = recomputed_layers(opts.recompute, shape.layers)
    activations = (shape.layers - k) * per_layer + k * per_input + (per_layer if k else 0)
    activations += act.outer_activation_bytes(shape, opts=a_opts, **dims)
    loss_width = 2 if opts.precision == "bf16" else 4
    logits = act.logits_bytes(
        shape, loss_bytes=loss_width, tensor_parallel=opts.tensor_parallel, **dims
    )
    workspace = ALLOCATOR_WORKSPACE_BYTES
    if opts.zero_stage == 3 and opts.world_size > opts.tensor_parallel:
        # FSDP/ZeRO-3 gathers one layer's 16-bit parameters and prefetches the next.
        workspace += 2 * _PRECISION_BYTES[opts.precision][0] * shape.layer_params
    static = states["params"] + states["master_weights"] + states["optimizer"]
    # A recomputed layer's activations are live during backward, after the logits are freed.
    live = per_layer if k else 0
    forward_backward = max(activations - live + logits, activations)
    allocated = workspace + static + max(forward_backward, states["grads"])
    breakdown = dict(states)
    breakdown |= {"activations": activations, "logits": logits}
    breakdown["workspace"] = workspace + CUDA_CONTEXT_BYTES
    breakdown["fragmentation_margin"] = math.ceil(opts.fragmentation_fraction * allocated)
    breakdown = {key: breakdown[key] for key in BREAKDOWN_KEYS}
    return MemoryEstimate(
        shape=shape,
        num_params=num_params,
        options=opts,
        breakdown=breakdown,
        allocated_peak_bytes=allocated,
    )
