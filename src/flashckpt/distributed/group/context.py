"""Where this process sits in a torch.distributed job, and the Store the ranks talk through.

A :class:`DistContext` exists when ``torch.distributed`` is initialized (torchrun, or
``init_process_group`` by hand). It holds the rank and world size of the process group the
Checkpointer works with and the job's c10d Store (the one ``init_process_group`` rendezvoused
through). Every coordination flashckpt does goes through that Store
(:mod:`flashckpt.distributed.group.barrier`), never through collectives, so it is safe on the
background save thread.

**Names every rank agrees on.** The Store keys of a Checkpointer live under a name derived from
its root (and an optional user ``name``) and the process group, never from how many
Checkpointers a process created: an extra Checkpointer on some ranks (an eval one, on another
root) cannot shift the others, and two Checkpointers on different roots never share a key.
Each operation's barrier is keyed by the operation, its step and an attempt number, under a
*generation* counted in the Store (``add(<name>/generation/<rank>, 1)`` when the context is
created): the k-th Checkpointer on a root on every rank meets the k-th on the others (a
Checkpointer re-created on the same root never reads the finished barriers of the one before),
and within it the k-th ``save(step)`` of every rank meets the k-th ``save(step)`` of the others.
Every attempt posts exactly once, even one that fails before its save job exists, so the counts
never drift apart; a save of another step never waits on a stale barrier. (torchelastic gives
each restart of the job its own Store prefix, so a restarted job starts counting afresh.)
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from flashckpt.distributed.group.barrier import StoreBarrier, raise_failed
from flashckpt.errors import ConfigError, DistributedError, FlashCkptError

log = logging.getLogger(__name__)


def store_name(group: str, root: str, name: str | None = None) -> str:
    """The Store prefix of a Checkpointer on ``root`` (``name`` replaces the root when given)."""
    ident = name if name is not None else root
    digest = hashlib.sha256(ident.encode()).hexdigest()[:20]
    return f"flashckpt/{group}/{digest}"


@dataclass(kw_only=True)
class DistContext:
    """Rank, world size and Store of one Checkpointer in a distributed job."""

    rank: int
    world_size: int
    store: Any
    timeout_s: float
    name: str  # derived from the root: identical on every rank
    generation: int = 0
    group: str = "world"
    root: str = ""
    _leftover: list[str] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)  # save thread vs training
    _attempts: dict[tuple[str, int | str], int] = field(default_factory=dict)

    @classmethod
    def detect(
        cls,
        *,
        process_group: Any = None,
        timeout_s: float = 300.0,
        root: str = "",
        name: str | None = None,
    ) -> DistContext | None:
        """The context of the current job, or None when torch.distributed is not initialized.

        ``process_group``: the group whose ranks write this checkpoint (default: the world).
        ``timeout_s``: how long a rank waits for the others at each commit phase.
        ``root`` / ``name``: what the Store keys are derived from (see the module docstring).
        """
        if not isinstance(timeout_s, (int, float)) or timeout_s <= 0:
            raise ConfigError(f"dist_timeout_s must be a positive number, got {timeout_s!r}")
        try:
            import torch.distributed as dist
        except ImportError:  # pragma: no cover - torch built without distributed
            return None
        if not (dist.is_available() and dist.is_initialized()):
            if process_group is not None:
                raise ConfigError(
                    "process_group was given but torch.distributed is not initialized; call "
                    "torch.distributed.init_process_group first (torchrun sets it up)"
                )
            return None
        from torch.distributed import distributed_c10d as c10d

        group: Any = process_group if process_group is not None else dist.group.WORLD
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        if rank < 0:
            raise ConfigError("this process is not a member of the given process_group")
        gname = c10d._get_process_group_name(group) if process_group is not None else "world"
        store = c10d._get_default_store()
        key = store_name(gname, root, name)
        gen = int(store.add(f"{key}/generation/{rank}", 1))
        log.debug("flashckpt distributed: rank %d of %d (%s, generation %d)", rank, world, key, gen)
        return cls(
            rank=rank,
            world_size=world,
            store=store,
            timeout_s=float(timeout_s),
            name=key,
            generation=gen,
            group=gname,
            root=root,
        )

    def attempt(self, op: str, step: int | str) -> int:
        """This rank's attempt number for ``op`` at ``step``: 1 for the first. Counts of older
        steps of ``op`` are dropped once a newer step starts (they are never retried then)."""
        n = self._attempts.get((op, step), 0) + 1
        if n == 1 and isinstance(step, int):
            for k in [k for k in self._attempts if k[0] == op and isinstance(k[1], int)]:
                if int(k[1]) < step:
                    del self._attempts[k]
        self._attempts[(op, step)] = n
        return n

    def barrier(self, op: str, step: int | str = 0) -> StoreBarrier:
        """The barrier of this rank's next attempt of ``op`` at ``step``."""
        prefix = f"{self.name}/g{self.generation}/{op}/{step}/{self.attempt(op, step)}"
        barrier = StoreBarrier(
            store=self.store,
            rank=self.rank,
            world_size=self.world_size,
            timeout_s=self.timeout_s,
            prefix=prefix,
        )
        if self.rank == 0:  # the keys of the barrier before: gone once this one's phase is full
            with self._lock:
                barrier.cleanup, self._leftover = self._leftover, []
        return barrier

    def finished(self, barrier: StoreBarrier) -> None:
        """Leader: hand the last keys of ``barrier`` to the next barrier to delete."""
        if self.rank == 0:
            with self._lock:
                self._leftover.extend(barrier.leftover_keys() + barrier.cleanup)


def agree_generation(ctx: DistContext, take: Callable[[], int]) -> int:
    """The run generation of this writer on every rank: rank 0 calls ``take()`` (it holds its
    writer lock) and posts it; the others wait for it (bounded by ``dist_timeout_s``). A failure
    of ``take()`` on rank 0 is raised on every rank as one DistributedError."""
    barrier = ctx.barrier("generation")
    try:
        value: dict[str, Any] = {"ok": True}
        if ctx.rank == 0:
            try:
                value["generation"] = take()
            except FlashCkptError as exc:
                value = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        values = barrier.exchange("generation", value)
        raise_failed(values, phase="generation", hint=" (taking the root's run generation)")
        gen = values[0].get("generation")
        if type(gen) is not int or gen < 1:
            raise DistributedError(
                f"rank 0 posted the run generation {gen!r}, not a positive integer",
                phase="generation",
                ranks=[0],
            )
        return gen
    finally:
        ctx.finished(barrier)
