"""The largest batch that fits a memory budget: found by the model, confirmed by trial steps.

The estimate is monotone in the batch size, so a doubling-then-bisecting search finds the
largest batch whose phase-aware peak, plus a safety margin, fits. Trials then confirm it by
binary search between the largest batch known to fit and the smallest known to fail. The
search never goes below 1: if batch 1 does not fit it says so (accelerate#1934 halved the batch
down to zero and failed with an unrelated error).
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

import torch

from flashckpt.errors import ConfigError
from flashckpt.memory.estimate import estimate
from flashckpt.memory.recompute.planner import MemoryPlanError
from flashckpt.memory.units import format_bytes, parse_bytes

log = logging.getLogger(__name__)

Trial = Callable[[int], int]


@dataclass(frozen=True, kw_only=True)
class BatchSizeResult:
    """The answer, the model's answer and every trial as ``(batch_size, peak_bytes or None)``."""

    batch_size: int
    model_batch_size: int | None
    budget_bytes: int
    trials: list[tuple[int, int | None]] = field(default_factory=list)


def _largest(fits: Callable[[int], bool], *, lo: int, hi: int | None, cap: int) -> int:
    """Largest b in [lo, cap] with fits(b), given fits(lo) and (if set) not fits(hi)."""
    if hi is None:
        probe = lo
        while probe < cap:
            nxt = min(cap, probe * 2)
            if not fits(nxt):
                hi = nxt
                break
            lo = probe = nxt
        if hi is None:
            return lo
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo


def model_max_batch_size(
    model_or_shape: Any, *, budget_bytes: int, max_batch: int = 1 << 16, **options: Any
) -> int:
    """Largest batch whose estimated peak fits ``budget_bytes`` (options as for ``estimate``).

    A Hugging Face model is traced at batch 1 and 2 and sized linearly in between and beyond
    (:class:`flashckpt.memory.sizing.TracedSizer`), not traced once per candidate.
    """
    traced = _traced_sizer(model_or_shape, options)
    if traced is not None:
        from flashckpt.memory.sizing import largest_batch

        found = largest_batch(
            traced, lambda est: est.peak_bytes <= budget_bytes, max_batch=max_batch
        )
        if found is None:
            _too_big(traced.estimate(batch_size=1).peak_bytes, budget_bytes)
        return cast(int, found)

    def fits(b: int) -> bool:
        return estimate(model_or_shape, batch_size=b, **options).peak_bytes <= budget_bytes

    if not fits(1):
        need = estimate(model_or_shape, batch_size=1, **options).peak_bytes
        raise MemoryPlanError(
            f"batch size 1 needs about {format_bytes(need)} but the budget is "
            f"{format_bytes(budget_bytes)}: recompute activations, shard (zero_stage=3), "
            "shorten the sequence or use a larger GPU"
        )
    return _largest(fits, lo=1, hi=None, cap=max_batch)


def _traced_sizer(model_or_shape: Any, options: dict[str, Any]) -> Any:
    config = getattr(model_or_shape, "config", None)
    traceable = isinstance(getattr(config, "vocab_size", None), int)
    if isinstance(model_or_shape, torch.nn.Module) and traceable and "inputs" not in options:
        from flashckpt.memory.sizing import TracedSizer

        opts = dict(options)
        if opts.pop("method", "auto") != "formula":
            return TracedSizer(model_or_shape, device=opts.pop("device", None), **opts)
    return None


def _too_big(need: int, budget_bytes: int) -> None:
    raise MemoryPlanError(
        f"batch size 1 needs about {format_bytes(need)} but the budget is "
        f"{format_bytes(budget_bytes)}: recompute activations, shard (zero_stage=3), "
        "shorten the sequence or use a larger GPU"
    )


def is_oom(exc: BaseException) -> bool:
    """Whether ``exc`` is a CUDA (or other device) out-of-memory error."""
    if isinstance(exc, torch.cuda.OutOfMemoryError):
        return True
    return isinstance(exc, RuntimeError) and "out of memory" in str(exc).lower()


def max_batch_size(
    model_or_shape: Any = None,
    *,
    budget_bytes: int | str,
    trial: Trial | None = None,
    safety_margin: float = 0.05,
    max_batch: int = 1 << 16,
    **options: Any,
) -> BatchSizeResult:
    """The largest batch that fits ``budget_bytes``.

    With ``model_or_shape`` the model proposes a batch (``seq_len`` and other ``estimate``
    options as keywords). With ``trial`` (``trial(batch_size) -> peak bytes``, raising an
    out-of-memory error when it does not fit; see :func:`cuda_trial`) the answer is confirmed by
    real steps: a batch fits when ``peak * (1 + safety_margin) <= budget``. Raises
    :class:`MemoryPlanError` when batch 1 does not fit.
    """
    budget = parse_bytes(budget_bytes, name="budget_bytes")
    if not 0 <= safety_margin < 1:
        raise ConfigError(f"safety_margin must be in [0, 1), got {safety_margin}")
    if model_or_shape is None and trial is None:
        raise ConfigError("max_batch_size needs a model/shape, a trial function, or both")
    guess = None
    if model_or_shape is not None:
        # the estimate's peak carries its own allocator margin; safety_margin is for the
        # trial's measured peaks (max_memory_allocated counts no fragmentation). Applying
        # both made the largest batch one below the truth (issue 32)
        guess = model_max_batch_size(
            model_or_shape,
            budget_bytes=budget,
            max_batch=max_batch,
            **options,
        )
    if trial is None:
        answer = cast(int, guess)  # set above: model_or_shape is given when trial is None
        return BatchSizeResult(batch_size=answer, model_batch_size=guess, budget_bytes=budget)
    trials: list[tuple[int, int | None]] = []

    def fits(b: int) -> bool:
        try:
            peak = int(trial(b))
        except Exception as exc:
            if not is_oom(exc):
                raise
            trials.append((b, None))
            return False
        trials.append((b, peak))
        return peak * (1 + safety_margin) <= budget

    start = guess or 1
    if fits(start):
        found = _largest(fits, lo=start, hi=None, cap=max_batch)
    elif start == 1 or not fits(1):
        raise MemoryPlanError(
            f"batch size 1 does not fit {format_bytes(budget)} in a trial step "
            f"(trials: {trials}); recompute more blocks, shard, or shorten sequences"
        )
    else:
        found = _largest(fits, lo=1, hi=start, cap=max_batch)
    return BatchSizeResult(
        batch_size=found, model_batch_size=guess, budget_bytes=budget, trials=trials
    )


def cuda_trial(step: Callable[[int], Any], *, device: Any = None) -> Trial:
    """Wrap ``step(batch_size)`` (one full training step) into a trial reporting peak bytes."""

    def run(batch_size: int) -> int:
        if not torch.cuda.is_available():
            raise ConfigError("cuda_trial needs a CUDA device; on CPU use the model's answer")
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        try:
            step(batch_size)
            torch.cuda.synchronize(device)
            return int(torch.cuda.max_memory_allocated(device))
        finally:
            gc.collect()
            torch.cuda.empty_cache()

    return run
