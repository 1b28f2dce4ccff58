"""GPU memory planning: will it fit, what to recompute, what to reserve, and watching the run.

See docs/guides/memory.md. A real model is measured: one training step traced on fake
tensors (:mod:`flashckpt.memory.trace.measure`). Shapes use formulas: ZeRO (Rajbhandari et al.
2020) for model states, Korthikanti et al. 2022 for activations (:mod:`.formula`).
"""

from flashckpt.memory.allocator.monitor import (
    Action,
    MemoryMonitor,
    MemorySample,
    MonitorPolicy,
    decide,
)
from flashckpt.memory.allocator.prealloc import (
    AllocatorSettings,
    PreallocationReport,
    apply_allocator_settings,
    preallocate,
    recommend_allocator_settings,
)
from flashckpt.memory.batch import BatchSizeResult, cuda_trial, max_batch_size, model_max_batch_size
from flashckpt.memory.estimate import (
    BREAKDOWN_KEYS,
    OPTIMIZER_IMPLS,
    OPTIMIZERS,
    PRECISIONS,
    EstimateOptions,
    MemoryEstimate,
    estimate,
    model_state_breakdown,
    model_state_bytes,
)
from flashckpt.memory.gpus import GPU, gpu_by_name, known_gpus
from flashckpt.memory.hf import build_hf_model, hf_config
from flashckpt.memory.recompute.planner import (
    MemoryPlanError,
    RecomputePlan,
    evaluate_plan,
    every_k_plan,
    min_activation_bytes,
    plan_recompute,
    sqrt_plan,
)
from flashckpt.memory.recompute.profile import BlockProfile, ModelProfile, find_blocks, profile
from flashckpt.memory.shape_profile import shape_profile
from flashckpt.memory.shapes import (
    TransformerShape,
    known_shapes,
    resolve_shape,
    shape_by_name,
    shape_from_hf_config,
)
from flashckpt.memory.units import format_bytes, parse_bytes

__all__ = [
    "BREAKDOWN_KEYS",
    "GPU",
    "OPTIMIZERS",
    "OPTIMIZER_IMPLS",
    "PRECISIONS",
    "Action",
    "AllocatorSettings",
    "BatchSizeResult",
    "BlockProfile",
    "EstimateOptions",
    "MemoryEstimate",
    "MemoryMonitor",
    "MemoryPlanError",
    "MemorySample",
    "ModelProfile",
    "MonitorPolicy",
    "PreallocationReport",
    "RecomputePlan",
    "TransformerShape",
    "apply_allocator_settings",
    "build_hf_model",
    "cuda_trial",
    "decide",
    "estimate",
    "evaluate_plan",
    "every_k_plan",
    "find_blocks",
    "format_bytes",
    "gpu_by_name",
    "hf_config",
    "known_gpus",
    "known_shapes",
    "max_batch_size",
    "min_activation_bytes",
    "model_max_batch_size",
    "model_state_breakdown",
    "model_state_bytes",
    "parse_bytes",
    "plan_recompute",
    "preallocate",
    "profile",
    "recommend_allocator_settings",
    "resolve_shape",
    "shape_by_name",
    "shape_from_hf_config",
    "shape_profile",
    "sqrt_plan",
]
