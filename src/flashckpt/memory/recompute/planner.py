"""Choose which blocks to recompute so activations fit a budget, at the least recompute time.

Cost model (per-block activation checkpointing, as non-reentrant ``torch.utils.checkpoint``
does it): with ``R`` the recomputed blocks, the peak activation memory is

    sum(activation_bytes of blocks not in R) + sum(input_bytes of blocks in R)
    + max(activation_bytes of blocks in R)

(the last term: one recomputed block's activations are live while it is recomputed during
backward), and the cost is ``sum(forward_s of R)`` (one extra forward per recomputed block).
:func:`plan_recompute` minimises the cost subject to ``peak <= budget`` exactly: for each
candidate largest recomputed block it solves a min-cost covering knapsack ("save at least D
bytes") exactly by branch and bound (:mod:`flashckpt.memory.recompute.cover`).
Baselines: every k-th block, and the per-block analogue of Chen et al. 2016's sqrt(n) rule.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.overrides import _get_current_function_mode_stack
from torch.utils.checkpoint import checkpoint

from flashckpt.errors import ConfigError, FlashCkptError
from flashckpt.memory.recompute.cover import min_cost_cover
from flashckpt.memory.recompute.profile import BlockProfile, ModelProfile
from flashckpt.memory.units import format_bytes

log = logging.getLogger(__name__)

_ORIGINAL_FORWARD = "_flashckpt_original_forward"


class MemoryPlanError(FlashCkptError):
    """No plan fits the memory budget; the message gives the smallest achievable peak."""


@dataclass(frozen=True, kw_only=True)
class RecomputePlan:
    """Blocks to recompute, the resulting peak activation bytes and the extra forward seconds."""

    recompute: tuple[str, ...]
    activation_bytes: int
    recompute_s: float
    budget_bytes: int | None = None
    method: str = "dp"

    def apply(self, model: nn.Module) -> nn.Module:
        """Wrap each planned block's forward in non-reentrant ``torch.utils.checkpoint``.

        Module names and ``state_dict`` keys do not change (the instance's ``forward`` is
        patched); RNG state is restored for the recompute so dropout masks, and hence the
        gradients, are identical to the plain model's. Blocks already wrapped are left alone.
        """
        modules = dict(model.named_modules())
        missing = [n for n in self.recompute if n not in modules]
        if missing:
            raise ConfigError(f"plan names blocks the model lacks: {missing}")
        for name in self.recompute:
            wrap_block(modules[name])
        return model

    def remove(self, model: nn.Module) -> nn.Module:
        """Undo :meth:`apply` for the planned blocks."""
        modules = dict(model.named_modules())
        for name in self.recompute:
            if name in modules:
                unwrap_block(modules[name])
        return model

    def describe(self) -> str:
        names = ", ".join(self.recompute) if self.recompute else "(none)"
        return (
            f"{self.method}: recompute {len(self.recompute)} block(s) [{names}]; peak "
            f"activations {format_bytes(self.activation_bytes)}; +{self.recompute_s:.4g} s/step"
        )


# Keyword arguments that carry a KV cache into a block, under the names HF models use.
_CACHE_KWARGS = ("cache", "past_key_values", "past_key_value", "layer_past")


def _without_cache(
    module: nn.Module, forward: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The call's arguments with the KV cache turned off, as HF's gradient checkpointing does.

    A block that writes a cache would append its K/V a second time when backward recomputes
    it (and with a padded batch the replay sees a longer cache and fails); training never
    reads that cache. The cache may come by keyword or by position (GPT-2 passes it second).
    Layers that only read a cache say so (``_can_checkpoint_with_cache``) and keep it.
    """
    names = ("use_cache", *_CACHE_KWARGS)
    try:
        bound = inspect.signature(forward).bind_partial(*args, **kwargs)
    except (TypeError, ValueError):  # no signature to bind: keywords only
        bound = None
    given = bound.arguments if bound is not None else kwargs
    flat = dict(given)
    flat.update(flat.pop("kwargs", None) or {})  # a **kwargs parameter, bound by name
    if not any(flat.get(name) for name in names):
        return args, kwargs
    keep_cache = getattr(module, "_can_checkpoint_with_cache", False)
    replace: dict[str, Any] = {"use_cache": False} if flat.get("use_cache") else {}
    if not keep_cache:
        replace |= {name: None for name in _CACHE_KWARGS if flat.get(name) is not None}
    for name, value in replace.items():
        if name in given:
            given[name] = value
        elif bound is not None and isinstance(given.get("kwargs"), dict):
            given["kwargs"][name] = value
    return (bound.args, bound.kwargs) if bound is not None else (args, given)


def _checkpointed(module: nn.Module, forward: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    if not torch.is_grad_enabled():
        return forward(*args, **kwargs)  # no backward, no replay: the block runs as is
    args, kwargs = _without_cache(module, forward, args, kwargs)
    modes = _get_current_function_mode_stack()
    if not modes:
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    def contexts() -> tuple[Any, Any]:
        # Backward runs without the forward's torch-function modes: replay under them too,
        # as checkpoint already does for autocast, so the recompute saves the same tensors.
        return contextlib.nullcontext(), _entered(modes)

    return checkpoint(forward, *args, use_reentrant=False, context_fn=contexts, **kwargs)


@contextlib.contextmanager
def _entered(modes: Sequence[Any]) -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        for mode in modes:
            stack.enter_context(mode)
        yield


def is_wrapped(module: nn.Module) -> bool:
    """Whether :func:`wrap_block` made ``module`` recompute its forward."""
    return _ORIGINAL_FORWARD in module.__dict__


def wrap_block(module: nn.Module) -> None:
    """Make ``module`` recompute its forward in backward (idempotent)."""
    if is_wrapped(module):
        return
    original = module.forward
    module.__dict__[_ORIGINAL_FORWARD] = original
    wrapped = functools.partial(_checkpointed, module, original)
    module.forward = wrapped  # type: ignore[method-assign]


def unwrap_block(module: nn.Module) -> None:
    """Restore a block wrapped by :func:`wrap_block`."""
    if _ORIGINAL_FORWARD in module.__dict__:
        del module.__dict__[_ORIGINAL_FORWARD]
        del module.__dict__["forward"]


def evaluate_plan(
    profile: ModelProfile, recompute: Iterable[str], *, method: str = "given"
) -> RecomputePlan:
    """Peak activation bytes and cost of recomputing the named blocks (the cost model above)."""
    chosen = set(recompute)
    unknown = chosen - set(profile.block_names)
    if unknown:
        raise ConfigError(f"unknown blocks {sorted(unknown)}; profile has {profile.block_names}")
    blocks = [b for b in profile.blocks if b.name in chosen]
    return RecomputePlan(
        recompute=tuple(b.name for b in profile.blocks if b.name in chosen),
        activation_bytes=_peak(profile.blocks, chosen) + profile.other_activation_bytes,
        recompute_s=sum(b.forward_s for b in blocks),
        method=method,
    )


def _peak(blocks: Sequence[BlockProfile], chosen: set[str]) -> int:
    kept = sum(b.activation_bytes for b in blocks if b.name not in chosen)
    inputs = sum(b.input_bytes for b in blocks if b.name in chosen)
    live = max((b.activation_bytes for b in blocks if b.name in chosen), default=0)
    return kept + inputs + live


def plan_recompute(profile: ModelProfile, budget_bytes: int) -> RecomputePlan:
    """The cheapest set of blocks to recompute so peak activation bytes <= ``budget_bytes``.

    Exact (dynamic programming; see the module docstring). Raises :class:`MemoryPlanError`
    when even recomputing every block cannot fit, naming the smallest achievable peak.
    """
    if budget_bytes < 0:
        raise ConfigError(f"budget_bytes must be >= 0, got {budget_bytes}")
    blocks = list(profile.blocks)
    budget = budget_bytes - profile.other_activation_bytes
    base = sum(b.activation_bytes for b in blocks)
    best: tuple[float, int, int, tuple[int, ...]] | None = None
    if base <= budget:
        best = (0.0, 0, base, ())
    for live in sorted({b.activation_bytes for b in blocks}):
        if best is not None and best[1] == 0:
            break  # recomputing nothing fits: nothing is cheaper
        allowed = [
            (b.activation_bytes - b.input_bytes, b.forward_s, i)
            for i, b in enumerate(blocks)
            if b.activation_bytes <= live
        ]
        need = base + live - budget
        beat = None if best is None else (best[0], best[1])
        found = min_cost_cover(allowed, max(need, 1), beat=beat)
        if found is None or not found[2]:
            continue
        chosen = {blocks[i].name for i in found[2]}
        peak = _peak(blocks, chosen)
        candidate = (found[0], found[1], peak, found[2])
        if best is None or candidate[:3] < best[:3]:
            best = candidate
    if best is None:
        floor = min_activation_bytes(profile)
        raise MemoryPlanError(
            f"no recompute plan fits {format_bytes(budget_bytes)} of activations: even "
            f"recomputing all {len(blocks)} blocks needs {format_bytes(floor)}; lower the batch "
            "size or sequence length, shard more (ZeRO-3/tensor parallel) or use a larger GPU"
        )
    plan = evaluate_plan(profile, (blocks[i].name for i in best[3]), method="dp")
    return RecomputePlan(
        recompute=plan.recompute,
        activation_bytes=plan.activation_bytes,
        recompute_s=plan.recompute_s,
        budget_bytes=budget_bytes,
        method="dp",
    )


def min_activation_bytes(profile: ModelProfile) -> int:
    """The smallest peak any plan reaches (recomputing exactly the blocks that save memory)."""
    best = profile.activation_bytes
    for live in {b.activation_bytes for b in profile.blocks}:
        chosen = {
            b.name
            for b in profile.blocks
            if b.activation_bytes <= live and b.activation_bytes > b.input_bytes
        }
        if chosen:
            peak = _peak(profile.blocks, chosen) + profile.other_activation_bytes
            best = min(best, peak)
    return best


def every_k_plan(profile: ModelProfile, *, k: int = 2) -> RecomputePlan:
    """Baseline: recompute every k-th block (blocks 0, k, 2k, ...), as ``ac_freq=k`` does."""
    if k < 1:
        raise ConfigError(f"k must be >= 1, got {k}")
    names = [b.name for i, b in enumerate(profile.blocks) if i % k == 0]
    return evaluate_plan(profile, names, method=f"every-{k}")


def sqrt_plan(profile: ModelProfile) -> RecomputePlan:
    """Baseline after Chen et al. 2016 ("Training Deep Nets with Sublinear Memory Cost"):
    keep about sqrt(n) evenly spaced blocks' activations, recompute the others."""
    n = len(profile.blocks)
    keep = max(1, math.isqrt(n))
    kept = {round(i * n / keep) for i in range(keep)} if n else set()
    names = [b.name for i, b in enumerate(profile.blocks) if i not in kept]
    return evaluate_plan(profile, names, method="sqrt(n)")
