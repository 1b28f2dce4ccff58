"""Watch CUDA memory per phase of a step, and decide what to do when a run nears its budget.

:class:`MemoryMonitor` samples ``torch.cuda.memory_stats`` at the end of each phase
(``forward``, ``backward``, ``optimizer``, ``checkpoint``), reports fragmentation (reserved -
allocated, and inactive split bytes: free pieces of split blocks that a larger request cannot
use) and allocator retries (``num_alloc_retries``: a ``cudaMalloc`` failed and the cache was
flushed, a sign the run is at the edge), journals each sample, and at the end of a step runs
:func:`decide`: a pure policy over recorded samples, so it is tested on recorded stats.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from flashckpt.errors import ConfigError
from flashckpt.memory.recompute.planner import RecomputePlan
from flashckpt.memory.units import format_bytes

log = logging.getLogger(__name__)

PHASES = ("forward", "backward", "optimizer", "checkpoint")


class JournalLike(Protocol):
    def append(self, event: str, /, **fields: Any) -> Any: ...


@dataclass(frozen=True, kw_only=True)
class MemorySample:
    """One reading of the allocator's counters, at the end of ``phase``."""

    phase: str
    allocated_bytes: int
    reserved_bytes: int
    max_allocated_bytes: int
    inactive_split_bytes: int
    alloc_retries: int
    num_ooms: int = 0

    @property
    def fragmentation_bytes(self) -> int:
        """Reserved but not allocated: cached memory no live tensor uses."""
        return max(0, self.reserved_bytes - self.allocated_bytes)

    @classmethod
    def from_stats(cls, phase: str, stats: Mapping[str, Any]) -> MemorySample:
        """Build from a ``torch.cuda.memory_stats()`` dict (missing keys read as 0)."""

        def get(key: str) -> int:
            return int(stats.get(key, 0))

        return cls(
            phase=phase,
            allocated_bytes=get("allocated_bytes.all.current"),
            reserved_bytes=get("reserved_bytes.all.current"),
            max_allocated_bytes=get("allocated_bytes.all.peak"),
            inactive_split_bytes=get("inactive_split_bytes.all.current"),
            alloc_retries=get("num_alloc_retries"),
            num_ooms=get("num_ooms"),
        )


@dataclass(frozen=True, kw_only=True)
class MonitorPolicy:
    """When to act. Fractions are of the budget; ``budget_bytes`` is the run's memory budget."""

    budget_bytes: int
    stricter_at: float = 0.92
    grow_at: float = 0.85
    fragmentation_at: float = 0.15
    shrink_below: float = 0.6
    margin: float = 0.05

    def __post_init__(self) -> None:
        if self.budget_bytes <= 0:
            raise ConfigError(f"MonitorPolicy.budget_bytes must be > 0, got {self.budget_bytes}")
        for name in ("stricter_at", "grow_at", "fragmentation_at", "shrink_below", "margin"):
            if not 0 <= getattr(self, name) <= 1:
                raise ConfigError(f"MonitorPolicy.{name} must be in [0, 1]")
        if self.grow_at > self.stricter_at:
            raise ConfigError("MonitorPolicy: grow_at must be <= stricter_at")


@dataclass(frozen=True, kw_only=True)
class Action:
    """A decision: ``stricter_recompute``, ``grow_reservation``, ``shrink_reservation``,
    ``enable_expandable_segments`` or ``ok``; ``reserve_bytes`` for reservation changes."""

    kind: str
    reason: str
    reserve_bytes: int = 0


def decide(
    samples: Sequence[MemorySample], policy: MonitorPolicy, *, previous_retries: int = 0
) -> list[Action]:
    """What to do after a step, given its per-phase samples (pure; tested on recorded stats)."""
    if not samples:
        return [Action(kind="ok", reason="no samples")]
    peak = max(s.max_allocated_bytes for s in samples)
    reserved = max(s.reserved_bytes for s in samples)
    retries = max(s.alloc_retries for s in samples) - previous_retries
    frag = max(s.inactive_split_bytes for s in samples)
    budget = policy.budget_bytes
    actions: list[Action] = []
    if retries > 0 or peak >= policy.stricter_at * budget:
        why = f"{retries} allocator retries" if retries > 0 else "peak near budget"
        actions.append(
            Action(
                kind="stricter_recompute",
                reason=f"{why}: peak {format_bytes(peak)} of budget {format_bytes(budget)}",
            )
        )
    elif peak >= policy.grow_at * budget or reserved < peak * (1 + policy.margin):
        target = min(budget, int(peak * (1 + policy.margin)))
        if target > reserved:
            actions.append(
                Action(
                    kind="grow_reservation",
                    reason=f"reserved {format_bytes(reserved)} < peak "
                    f"{format_bytes(peak)} + margin",
                    reserve_bytes=target,
                )
            )
    elif reserved > 0 and peak < policy.shrink_below * reserved:
        actions.append(
            Action(
                kind="shrink_reservation",
                reason=f"peak {format_bytes(peak)} uses under {policy.shrink_below:.0%} of "
                f"reserved {format_bytes(reserved)}",
                reserve_bytes=int(peak * (1 + policy.margin)),
            )
        )
    if reserved > 0 and frag > policy.fragmentation_at * reserved:
        actions.append(
            Action(
                kind="enable_expandable_segments",
                reason=f"inactive split bytes {format_bytes(frag)} exceed "
                f"{policy.fragmentation_at:.0%} of reserved {format_bytes(reserved)}",
            )
        )
    return actions or [Action(kind="ok", reason=f"peak {format_bytes(peak)} within budget")]


class MemoryMonitor:
    """Samples memory per phase, journals it, and applies stricter recompute plans.

    ``plans``: recompute plans from least to most strict; the first is assumed applied (or
    none). ``stats_fn`` replaces ``torch.cuda.memory_stats`` (for tests and replay). Without
    CUDA and without ``stats_fn`` the monitor records nothing and says so once.
    """

    def __init__(
        self,
        *,
        policy: MonitorPolicy,
        device: Any = None,
        journal: JournalLike | None = None,
        model: torch.nn.Module | None = None,
        plans: Sequence[RecomputePlan] = (),
        stats_fn: Callable[[], Mapping[str, Any]] | None = None,
    ) -> None:
        self.policy = policy
        self.device = device
        self.journal = journal
        self.model = model
        self.plans = list(plans)
        self.plan_index = 0
        self.samples: list[MemorySample] = []
        self.history: list[list[Action]] = []
        self._retries = 0
        self._stats_fn = stats_fn
        self._cuda = stats_fn is None and torch.cuda.is_available()
        if self._cuda:
            self._stats_fn = lambda: torch.cuda.memory_stats(self.device)
        if self._stats_fn is None:
            log.info(
                "MemoryMonitor: no CUDA device; would sample torch.cuda.memory_stats per phase"
            )

    @property
    def active(self) -> bool:
        return self._stats_fn is not None

    def sample(self, phase: str) -> MemorySample | None:
        """Record one sample now, tagged ``phase``; journal it as a ``memory`` event."""
        if self._stats_fn is None:
            return None
        sample = MemorySample.from_stats(phase, self._stats_fn())
        self.samples.append(sample)
        if self.journal is not None:
            self.journal.append(
                "memory",
                phase=phase,
                allocated_bytes=sample.allocated_bytes,
                reserved_bytes=sample.reserved_bytes,
                max_allocated_bytes=sample.max_allocated_bytes,
                fragmentation_bytes=sample.fragmentation_bytes,
                alloc_retries=sample.alloc_retries,
            )
        return sample

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """``with monitor.phase("forward"): ...`` samples when the block ends."""
        if name not in PHASES:
            raise ConfigError(f"phase {name!r}; accepted: {', '.join(PHASES)}")
        yield
        self.sample(name)

    def end_step(self) -> list[Action]:
        """Decide on this step's samples, apply a stricter plan if asked, reset for the next."""
        actions = decide(self.samples, self.policy, previous_retries=self._retries)
        if self.samples:
            self._retries = max(s.alloc_retries for s in self.samples)
        for action in actions:
            if action.kind == "stricter_recompute":
                self._switch_plan(action)
            elif action.kind != "ok":
                self._adjust(action)
        self.history.append(actions)
        self.samples = []
        if self._cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        return actions

    def _adjust(self, action: Action) -> None:
        log.info("memory: %s (%s)", action.kind, action.reason)
        if not self._cuda:
            return  # replayed stats: decide only
        if action.kind == "grow_reservation":
            self._grow(action.reserve_bytes)
        elif action.kind == "shrink_reservation":
            torch.cuda.empty_cache()

    def _grow(self, target_bytes: int) -> None:
        """Reserve up to ``target_bytes``, only out of memory the device has free (less a
        margin): growing never raises an out-of-memory error in the middle of training."""
        have = torch.cuda.memory_reserved(self.device)
        free, total = torch.cuda.mem_get_info(self.device)
        room = max(0, free - int(total * self.policy.margin))
        target = min(target_bytes, have + room)
        if target <= have:
            log.warning(
                "memory: not growing the reservation to %s: %s free on the device",
                format_bytes(target_bytes),
                format_bytes(free),
            )
            return
        try:  # one block, freed back to the cache, which keeps the segment (as preallocate)
            block = torch.empty(target - have, dtype=torch.uint8, device=self.device or "cuda")
            del block
        except torch.cuda.OutOfMemoryError as exc:
            log.warning("memory: growing the reservation failed, left as it is (%s)", exc)

    def _switch_plan(self, action: Action) -> None:
        if self.model is None or self.plan_index + 1 >= len(self.plans):
            log.warning("memory: %s, and no stricter recompute plan is available", action.reason)
            return
        self.plans[self.plan_index].remove(self.model)
        self.plan_index += 1
        self.plans[self.plan_index].apply(self.model)
        log.warning("memory: %s; now %s", action.reason, self.plans[self.plan_index].describe())
