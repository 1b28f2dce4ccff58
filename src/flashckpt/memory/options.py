"""What decides per-GPU memory besides the model, the result type, and the model-state formulas.

Model states follow the ZeRO paper (Rajbhandari et al. 2020, "ZeRO: Memory Optimizations
Toward Training Trillion Parameter Models", section 3.1): mixed-precision Adam keeps 2 bytes of
16-bit parameters, 2 of 16-bit gradients and 12 of fp32 optimizer state (master weights,
momentum, variance) per parameter, ``16*Psi`` in all; stage 1 shards the 12 over ``N`` ranks
(``4*Psi + 12*Psi/N``), stage 2 also the gradients (``2*Psi + 14*Psi/N``) and stage 3 also the
parameters (``16*Psi/N``; FSDP full sharding).

PyTorch autocast ("bf16-mixed" in Lightning) keeps fp32 parameters and gradients and caches
16-bit weight copies for the step; its peaks equal the ZeRO accounting: ``2+4+8`` bytes/param
during forward/backward (copies + fp32 weights + Adam) and ``4+4+8`` at the optimizer step,
plus, with PyTorch's default foreach AdamW, one state-sized temporary (``sqrt(v)``) at the step.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from flashckpt.errors import ConfigError
from flashckpt.memory import activations as act
from flashckpt.memory.shapes import TransformerShape
from flashckpt.memory.units import MIB, format_bytes

log = logging.getLogger(__name__)

PRECISIONS = ("fp32", "bf16-mixed", "fp16-mixed", "bf16")
OPTIMIZERS = ("adam", "adamw", "sgd", "sgd-momentum", "adafactor", "adamw-8bit")
OPTIMIZER_IMPLS = ("foreach", "fused", "for-loop")
BREAKDOWN_KEYS = (
    "params",
    "grads",
    "optimizer",
    "optimizer_temp",
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
# bitsandbytes 8-bit Adam: two uint8 moments plus one fp32 absmax per 256-value block each.
ADAM_8BIT_BYTES_PER_PARAM = 2 + 2 * 4 / 256
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


def _optimizer_bytes(optimizer: str, moment_b: int) -> float:
    if optimizer == "adafactor":
        return ADAFACTOR_BYTES_PER_PARAM
    if optimizer == "adamw-8bit":
        return ADAM_8BIT_BYTES_PER_PARAM
    return _MOMENTS[optimizer] * moment_b


def model_state_breakdown(
    num_params: int,
    *,
    optimizer: str = "adamw",
    precision: str = "bf16-mixed",
    zero_stage: int = 0,
    world_size: int = 1,
    tensor_parallel: int = 1,
    trainable_fraction: float = 1.0,
    optimizer_offload: bool = False,
) -> dict[str, int]:
    """Per-GPU bytes of ``params``, ``grads``, ``optimizer`` and ``master_weights`` (ZeRO paper).

    ``world_size`` counts all GPUs; ZeRO shards over the data-parallel ``world_size /
    tensor_parallel`` ranks, tensor parallelism splits every state ``tensor_parallel`` ways.
    ``trainable_fraction`` (LoRA and other partial fine-tuning) scales gradients, optimizer
    state and master weights; ``optimizer_offload`` keeps the latter two in host memory.
    """
    _check_choice("precision", precision, PRECISIONS)
    _check_choice("optimizer", optimizer, OPTIMIZERS)
    _check_parallel(zero_stage, world_size, tensor_parallel)
    if num_params < 0:
        raise ConfigError(f"num_params must be >= 0, got {num_params}")
    _check_fraction(trainable_fraction)
    p_b, g_b, m_b, moment_b = _PRECISION_BYTES[precision]
    opt_b = _optimizer_bytes(optimizer, moment_b)
    local = math.ceil(num_params / tensor_parallel)
    dp = world_size // tensor_parallel
    off = 0 if optimizer_offload else 1

    def per_gpu(bytes_per_param: float, sharded: bool, share: float = 1.0) -> int:
        total = math.ceil(local * share * bytes_per_param)
        return math.ceil(total / dp) if sharded else total

    f = trainable_fraction
    return {
        "params": per_gpu(p_b, zero_stage >= 3),
        "grads": per_gpu(g_b, zero_stage >= 2, f),
        "optimizer": per_gpu(opt_b * off, zero_stage >= 1, f),
        "master_weights": per_gpu(m_b * off, zero_stage >= 1, f),
    }


def _check_fraction(fraction: float) -> None:
    if not 0 < fraction <= 1:
        raise ConfigError(
            f"trainable_fraction={fraction}; must be in (0, 1] (e.g. 0.01 for LoRA adapters)"
        )


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
    """Everything besides the model that decides per-GPU memory; validated on construction.

    ``optimizer_impl``: PyTorch's implementation of the optimizer step — ``foreach`` (the
    default on CUDA; one state-sized temporary), ``fused`` or ``for-loop``. ``grad_accum``:
    micro-batches per optimizer step (gradients stay alive across them). ``dropout``: None
    means the model's own (off for formula shapes).
    """

    batch_size: int
    seq_len: int
    precision: str = "bf16-mixed"
    optimizer: Any = "adamw"
    optimizer_impl: str = "foreach"
    grad_accum: int = 1
    zero_stage: int = 0
    world_size: int = 1
    tensor_parallel: int = 1
    sequence_parallel: bool = False
    flash_attention: bool = True
    recompute: Any = None
    dropout: bool | None = None
    residual_fp32: bool | None = None
    trainable_fraction: float = 1.0
    optimizer_offload: bool = False
    # None: the margin comes from the allocator's rules (memory/allocator/blocks.py) for the
    # setting below; a number: that share of the allocated peak instead
    fragmentation_fraction: float | None = None
    expandable_segments: bool = True  # PYTORCH_CUDA_ALLOC_CONF (flashckpt.memory.preallocate)

    def __post_init__(self) -> None:
        if self.batch_size < 1 or self.seq_len < 1:
            raise ConfigError(
                f"batch_size={self.batch_size} and seq_len={self.seq_len} must be >= 1"
            )
        _check_choice("precision", self.precision, PRECISIONS)
        if not callable(self.optimizer):
            _check_choice("optimizer", self.optimizer, OPTIMIZERS)
        _check_choice("optimizer_impl", self.optimizer_impl, OPTIMIZER_IMPLS)
        _check_parallel(self.zero_stage, self.world_size, self.tensor_parallel)
        _check_fraction(self.trainable_fraction)
        if self.grad_accum < 1:
            raise ConfigError(f"grad_accum={self.grad_accum}; must be >= 1 micro-batch")
        frac = self.fragmentation_fraction
        if frac is not None and (isinstance(frac, bool) or not 0 <= frac < 1):
            raise ConfigError(
                "fragmentation_fraction must be None (the allocator's rules) or in [0, 1), "
                f"e.g. 0.05; got {frac!r}"
            )

    def activation_options(self) -> act.ActivationOptions:
        residual_fp32 = self.residual_fp32
        if residual_fp32 is None:
            residual_fp32 = self.precision.endswith("-mixed")
        width = 4 if self.precision == "fp32" else 2
        return act.ActivationOptions(
            act_bytes=width,
            residual_bytes=4 if residual_fp32 else width,
            flash_attention=self.flash_attention,
            dropout=bool(self.dropout),
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

    ``method``: ``"traced"`` (one real step of the model metered on fake tensors, see
    :mod:`flashckpt.memory.trace.measure`) or ``"formula"`` (closed forms for a shape).
    ``breakdown`` holds each part at its own maximum; ``total_bytes`` is their sum, an upper bound.
    ``peak_bytes`` is phase-aware: the largest of the phases' peaks (``phase_peaks``: forward
    and backward, the optimizer step), plus the CUDA context and the fragmentation margin.
    ``allocated_peak_bytes`` leaves out those two and is what ``torch.cuda.max_memory_allocated``
    measures.
    """

    shape: TransformerShape | None
    num_params: int
    options: EstimateOptions
    breakdown: dict[str, int] = field(default_factory=dict)
    allocated_peak_bytes: int
    context_bytes: int = CUDA_CONTEXT_BYTES
    method: str = "formula"
    phase_peaks: dict[str, int] = field(default_factory=dict)
    notes: tuple[str, ...] = ()

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
        rows.append(f"  ({self.method} estimate)")
        return "\n".join(rows)
