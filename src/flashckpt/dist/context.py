"""Where this process sits in a torch.distributed job, and the Store the ranks talk through.

A :class:`DistContext` exists when ``torch.distributed`` is initialized (torchrun, or
``init_process_group`` by hand). It holds the rank and world size of the process group the
Checkpointer works with and the job's c10d Store (the one ``init_process_group`` rendezvoused
through), under a prefix unique to each Checkpointer. Every coordination flashckpt does goes
through that Store (:mod:`flashckpt.dist.barrier`), never through collectives, so it is safe on
the background save thread.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass
from typing import Any

from flashckpt.dist.barrier import StoreBarrier
from flashckpt.errors import ConfigError

log = logging.getLogger(__name__)

_instances = itertools.count()


@dataclass(kw_only=True)
class DistContext:
    """Rank, world size and Store of one Checkpointer in a distributed job."""

    rank: int
    world_size: int
    store: Any
    timeout_s: float
    name: str  # unique per Checkpointer, identical on every rank (SPMD creation order)

    def __post_init__(self) -> None:
        self._ops = itertools.count()

    @classmethod
    def detect(cls, *, process_group: Any = None, timeout_s: float = 300.0) -> DistContext | None:
        """The context of the current job, or None when torch.distributed is not initialized.

        ``process_group``: the group whose ranks write this checkpoint (default: the world).
        ``timeout_s``: how long a rank waits for the others at each commit phase.
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
        name = f"flashckpt/{gname}/{next(_instances)}"
        log.debug("flashckpt distributed: rank %d of %d (%s)", rank, world, name)
        return cls(rank=rank, world_size=world, store=store, timeout_s=float(timeout_s), name=name)

    def barrier(self, op: str) -> StoreBarrier:
        """A fresh barrier for one operation (a save, a restore); every rank must create its
        barriers in the same order, as they do when they run the same training script."""
        return StoreBarrier(
            store=self.store,
            rank=self.rank,
            world_size=self.world_size,
            timeout_s=self.timeout_s,
            prefix=f"{self.name}/{op}-{next(self._ops)}",
        )
