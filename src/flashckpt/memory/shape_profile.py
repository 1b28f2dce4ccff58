"""A :class:`ModelProfile` computed from a shape, for planning models you cannot run here.

Block activation and input bytes come from :mod:`flashckpt.memory.activations`; forward time
is the block's matmul FLOPs (``2 * params * tokens`` plus attention ``4 * s^2 * b * h``, Kaplan
et al. 2020 / Narayanan et al. 2021) over the GPU's bf16 peak times an assumed utilisation.
"""

from __future__ import annotations

import logging
from typing import Any

from flashckpt.errors import ConfigError
from flashckpt.memory import activations as act
from flashckpt.memory.estimate import EstimateOptions
from flashckpt.memory.recompute.profile import BlockProfile, ModelProfile
from flashckpt.memory.shapes import resolve_shape

log = logging.getLogger(__name__)


def shape_profile(
    model_or_shape: Any, *, tflops: float = 400.0, utilization: float = 0.4, **options: Any
) -> ModelProfile:
    """Per-layer profile of a shape (options as for ``estimate``: batch_size, seq_len, ...)."""
    if tflops <= 0 or not 0 < utilization <= 1:
        raise ConfigError("tflops must be > 0 and utilization in (0, 1]")
    shape = resolve_shape(model_or_shape)
    opts = EstimateOptions(**options)
    a_opts = opts.activation_options()
    dims = {"batch_size": opts.batch_size, "seq_len": opts.seq_len}
    per_layer = act.layer_activation_bytes(shape, opts=a_opts, **dims)
    per_input = act.layer_input_bytes(shape, opts=a_opts, **dims)
    tokens = opts.batch_size * opts.seq_len
    flops = 2 * shape.layer_params * tokens + 4 * opts.seq_len * tokens * shape.hidden
    forward_s = flops / opts.tensor_parallel / (tflops * 1e12 * utilization)
    blocks = [
        BlockProfile(
            name=f"layers.{i}",
            activation_bytes=per_layer,
            input_bytes=per_input,
            forward_s=forward_s,
        )
        for i in range(shape.layers)
    ]
    outer = act.outer_activation_bytes(shape, opts=a_opts, **dims)
    return ModelProfile(
        blocks=blocks, other_activation_bytes=outer, forward_s=forward_s * shape.layers
    )
