"""One object that sizes a setup at any batch, plan and world size: traced or by formula.

``flashckpt plan`` asks many questions of one model (does it fit; with which recompute plan;
the largest batch; the fewest GPUs per ZeRO stage). :class:`Sizer` answers them all from one
source: a :class:`TracedSizer` traces the model's step once per (batch, plan) and reuses the
trace for every world size and ZeRO stage (sharding is applied to the metered states), and
sizes other batches from two traces (activations are linear in the batch at a fixed sequence
length); a :class:`FormulaSizer` uses the closed forms.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any

from torch import nn

from flashckpt.memory.formula import formula_estimate
from flashckpt.memory.options import EstimateOptions, MemoryEstimate
from flashckpt.memory.recompute.profile import BlockProfile, ModelProfile, find_blocks
from flashckpt.memory.shape_profile import shape_profile
from flashckpt.memory.shapes import TransformerShape
from flashckpt.memory.trace.measure import default_device, trace_model, traced_estimate
from flashckpt.memory.trace.traced import TracedStep

log = logging.getLogger(__name__)


def _plan_key(recompute: Any) -> Any:
    if recompute is None:
        return None
    if hasattr(recompute, "recompute"):
        return tuple(recompute.recompute)
    return recompute if isinstance(recompute, (str, int)) else tuple(recompute)


class FormulaSizer:
    """Closed-form answers for a shape (see :mod:`flashckpt.memory.formula`)."""

    method = "formula"

    def __init__(self, shape: TransformerShape, **base: Any) -> None:
        self.shape = shape
        self.base = base

    def estimate(self, **options: Any) -> MemoryEstimate:
        opts = EstimateOptions(**(self.base | options))
        return formula_estimate(self.shape, self.shape.num_params, opts)

    def profile(self, *, tflops: float, **options: Any) -> ModelProfile:
        return shape_profile(self.shape, tflops=tflops, **(self.base | options))


def _extrapolate(one: TracedStep, two: TracedStep, batch: float) -> TracedStep:
    """The step at ``batch`` on the line through steps at 1 and 2 (per phase and category)."""
    at_peak = {}
    for phase, row in one.at_peak.items():
        other = two.at_peak[phase]
        line = {k: v + (other[k] - v) * (batch - 1) for k, v in row.items()}
        # the moment of the peak may differ between the two traces, so one category can shrink
        # while another grows: keep the sum on the line, no category below zero
        rest = line["activations"] + line["logits"]
        line["logits"] = min(max(0, line["logits"]), max(0, rest))
        line["activations"] = rest - line["logits"]
        at_peak[phase] = {k: int(max(0, v) if k != "activations" else v) for k, v in line.items()}
    peaks = {phase: sum(row.values()) for phase, row in at_peak.items()}
    return dataclasses.replace(one, peaks=peaks, at_peak=at_peak)


class TracedSizer:
    """Traced answers for a model (any device, ``meta`` included); traces are cached."""

    method = "traced"

    def __init__(self, model: nn.Module, *, device: str | None = None, **base: Any) -> None:
        self.model = model
        self.device = device or default_device()
        self.base = base
        self._traces: dict[Any, TracedStep] = {}
        self.shape: TransformerShape | None = None
        modules = dict(model.named_modules())
        self.blocks = find_blocks(model)
        self.block_params = [sum(p.numel() for p in modules[b].parameters()) for b in self.blocks]

    def _trace(self, batch: int, recompute: Any) -> TracedStep:
        key = (batch, _plan_key(recompute))
        if key not in self._traces:
            opts = EstimateOptions(**(self.base | {"batch_size": batch, "recompute": recompute}))
            self._traces[key] = trace_model(self.model, opts, device=self.device)
        return self._traces[key]

    def traces(self) -> int:
        return len(self._traces)

    def estimate(self, *, exact: bool = False, **options: Any) -> MemoryEstimate:
        """The estimate at ``batch_size``: traced if ``exact`` (or batch <= 2), else on the line
        through the two traced batches nearest to it (the peak is convex in the batch, so a
        line outside its points is low: :func:`largest_batch` confirms by tracing)."""
        merged = self.base | options
        if merged.get("recompute") == "full":  # the same trace as the plan of every block
            merged["recompute"] = tuple(self.blocks)
        opts = EstimateOptions(**merged)
        batch, recompute = opts.batch_size, opts.recompute
        if exact or (batch, _plan_key(recompute)) in self._traces or batch <= 2:
            traced = self._trace(batch, recompute)
        else:
            self._trace(1, recompute), self._trace(2, recompute)
            have = sorted(
                (abs(b - batch), b) for b, key in self._traces if key == _plan_key(recompute)
            )
            lo, hi = sorted(b for _, b in have[:2])
            one, two = (
                self._traces[(lo, _plan_key(recompute))],
                self._traces[(hi, _plan_key(recompute))],
            )
            traced = _extrapolate(one, two, (batch - lo) / (hi - lo) + 1)
        return traced_estimate(traced, opts, layer_params=max(self.block_params, default=0))

    def profile(self, *, tflops: float, utilization: float = 0.4, **options: Any) -> ModelProfile:
        """Per-block saved bytes, measured with saved-tensor hooks on fake tensors."""
        opts = EstimateOptions(**(self.base | options))
        full = self.estimate(**(options | {"recompute": None}))
        none_act = full.breakdown["activations"]
        blocks = []
        tokens = opts.batch_size * opts.seq_len
        per_block = self._per_block_bytes(opts)
        for name, params, (saved, inputs) in zip(
            self.blocks, self.block_params, per_block, strict=True
        ):
            flops = 2 * params * tokens  # one forward of the block's matmuls
            forward_s = flops / (tflops * 1e12 * utilization)
            blocks.append(
                BlockProfile(
                    name=name, activation_bytes=saved, input_bytes=inputs, forward_s=forward_s
                )
            )
        other = max(0, none_act - sum(b.activation_bytes for b in blocks))
        return ModelProfile(
            blocks=blocks,
            other_activation_bytes=other,
            forward_s=sum(b.forward_s for b in blocks),
            device="meta",
        )

    def _per_block_bytes(self, opts: EstimateOptions) -> list[tuple[int, int]]:
        """(saved bytes, input bytes) per block, from a fake forward with saved-tensor hooks."""
        from flashckpt.memory.trace.measure import profile_blocks

        start = time.perf_counter()
        out = profile_blocks(self.model, opts, device=self.device, blocks=self.blocks)
        log.debug("profiled %d blocks in %.1f s", len(out), time.perf_counter() - start)
        return out


def largest_batch(
    sizer: FormulaSizer | TracedSizer,
    fits: Callable[[MemoryEstimate], bool],
    *,
    max_batch: int = 1 << 16,
    **options: Any,
) -> int | None:
    """The largest batch whose estimate ``fits`` (None if batch 1 does not); for a traced
    sizer the answer is confirmed by tracing it and the next batch, re-searching if needed."""

    def ok(b: int, exact: bool = False) -> bool:
        if isinstance(sizer, TracedSizer):
            return fits(sizer.estimate(batch_size=b, exact=exact, **options))
        return fits(sizer.estimate(batch_size=b, **options))

    if not ok(1):
        return None
    for _ in range(6):
        lo, hi = 1, 2
        while hi <= max_batch and ok(hi):
            lo, hi = hi, hi * 2
        hi = min(hi, max_batch + 1)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if ok(mid) else (lo, mid)
        if not isinstance(sizer, TracedSizer):
            return lo
        if ok(lo, exact=True) and (lo >= max_batch or not ok(lo + 1, exact=True)):
            return lo  # both traced: exact
    return lo


def sizer_for(model: Any, **base: Any) -> FormulaSizer | TracedSizer:
    """A traced sizer for an ``nn.Module``, else a formula sizer for the shape it names."""
    if isinstance(model, nn.Module):
        return TracedSizer(model, **base)
    from flashckpt.memory.shapes import resolve_shape

    return FormulaSizer(resolve_shape(model), **base)
