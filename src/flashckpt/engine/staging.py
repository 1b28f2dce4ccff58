"""The staging pool: host buffers allocated once, reused by every save, bounded by a budget.

Admission works on fixed slots of ``slot_bytes`` (the largest chunk): a chunk is staged only
when a slot is free, and a slot returns to the pool in ``finally`` when its chunk is written.
With at least one slot, one chunk is always admitted when nothing is in flight, so a state
larger than the budget flows through in waves without deadlock. On CUDA the arena is pinned
(allocated once, since ``cudaHostAlloc`` is slow); if pinning fails it falls back to pageable
memory with a warning.
"""

from __future__ import annotations

import logging
import threading

import torch

log = logging.getLogger(__name__)


class StagingPool:
    def __init__(self, *, budget_bytes: int, slot_bytes: int) -> None:
        self.slot_bytes = max(1, slot_bytes)
        self.max_slots = max(1, budget_bytes // self.slot_bytes)
        self._arena: torch.Tensor | None = None
        self._pinned = False
        self._free: list[int] = []
        self._cond = threading.Condition()

    @property
    def capacity_bytes(self) -> int:
        return 0 if self._arena is None else self._arena.numel()

    @property
    def pinned(self) -> bool:
        return self._pinned

    def reserve(self, *, needed_bytes: int, pin: bool) -> None:
        """Size the arena for a save of ``needed_bytes`` (never beyond the budget). Called
        between saves only; the arena grows at most once per new high-water mark."""
        slots = min(self.max_slots, max(1, -(-needed_bytes // self.slot_bytes)))
        with self._cond:
            have = 0 if self._arena is None else self._arena.numel() // self.slot_bytes
            if slots <= have and (self._pinned or not pin):
                return
            slots = max(slots, have)
            self._arena = None
            self._arena = _alloc(slots * self.slot_bytes, pin)
            self._pinned = pin and self._arena.is_pinned()
            self._free = list(range(slots))

    def free_slots(self) -> int:
        with self._cond:
            return len(self._free)

    def acquire(self) -> int:
        with self._cond:
            while not self._free:
                self._cond.wait()
            return self._free.pop()

    def release(self, slot: int) -> None:
        with self._cond:
            self._free.append(slot)
            self._cond.notify()

    def view(self, slot: int, nbytes: int) -> torch.Tensor:
        if self._arena is None:
            raise RuntimeError("staging pool used before reserve()")
        start = slot * self.slot_bytes
        return self._arena[start : start + nbytes]


def _alloc(nbytes: int, pin: bool) -> torch.Tensor:
    if pin:
        try:
            return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        except RuntimeError as exc:
            log.warning(
                "could not pin %d bytes of staging memory (%s); using pageable", nbytes, exc
            )
    return torch.empty(nbytes, dtype=torch.uint8)
