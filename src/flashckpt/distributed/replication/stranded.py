"""Steps that only the node-local memory tiers hold, copied to the disk tier over the Store.

A step published in the node tiers reaches a tier that survives its node in a replication round
(the replica on the peer node, and the disk tier when its retention wants the step:
:mod:`flashckpt.distributed.replication.nodepromote`). When the round fails or replication
stops (a slow or dead peer: the gloo side group does not recover), such a step is *stranded*:
reported saved, yet lost with its node. This module promotes the stranded steps without the side
group, through the job's Store barrier (the training thread, every rank):

1. every rank posts the steps its node tier holds; the candidates are the steps every rank's node
   tier holds (each rank reads its own chunks from its own tier), newest first;
2. for each candidate, the same four steps as a replication round's promotion
   (:func:`~flashckpt.distributed.replication.nodepromote.promote_round`: rank 0 decides whether
   the disk tier wants it, every rank copies the chunks it wrote, rank 0 commits the manifest),
   with each all-reduce carried by the Store barrier (:class:`StoreReduce`).

It runs at the first save after the ranks agreed that the memory tier is suspended
(:mod:`flashckpt.distributed.attempt`) and at a clean ``close()`` (:mod:`flashckpt.distributed.
closing`). So a step reported saved is replicated within one round (``Replication.timeout_s``),
or on disk by the next save or ``close()``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

from flashckpt.distributed.group.barrier import StoreBarrier
from flashckpt.distributed.replication.nodepromote import promote_round
from flashckpt.errors import FlashCkptError
from flashckpt.journal import Journal
from flashckpt.store.format.manifest import Manifest

log = logging.getLogger(__name__)

_OPS: dict[str, Callable[[Iterable[int]], int]] = {"sum": sum, "min": min, "max": max}


class StoreReduce:
    """The one call of :class:`~flashckpt.distributed.replication.transfer.Exchange` that a
    promotion needs (``all_reduce``), carried by a Store barrier instead of the side group."""

    def __init__(self, barrier: StoreBarrier, name: str) -> None:
        self.barrier = barrier
        self.name = name
        self.n = 0

    def all_reduce(self, values: list[int], op: str = "sum") -> list[int]:
        self.n += 1
        got = self.barrier.exchange(f"{self.name}-{self.n}", {"ok": True, "v": list(values)})
        return [_OPS[op](int(x) for x in col) for col in zip(*(g["v"] for g in got))]


def promote_stranded(
    barrier: StoreBarrier, *, rank: int, tiers: Any, journal: Journal
) -> list[int]:
    """Steps 1-2 of the module docstring; the steps committed in the disk tier (rank 0's view).
    Every rank calls it with a barrier of the same operation; a rank that does not arrive makes
    it raise :class:`~flashckpt.errors.DistributedError` on every rank."""
    mem, local = tiers.by_name("memory"), tiers.by_name("local")
    mine: list[int] = []
    if mem is not None and local is not None:
        try:
            mine = list(mem.store.steps())
        except FlashCkptError as exc:
            log.warning("cannot list the memory tier %s: %s", mem.url, exc)
    values = barrier.exchange("stranded", {"ok": True, "steps": mine})
    common = set(values[0]["steps"])
    for v in values[1:]:
        common &= set(v["steps"])
    done = []
    for step in sorted(common, reverse=True):
        manifest = _manifest(mem, step, len(values))
        ex = StoreReduce(barrier, f"stranded-{step}")
        if ex.all_reduce([0 if manifest is not None else 1])[0] or manifest is None:
            continue  # a rank cannot read it: the same verdict everywhere
        if promote_round(
            ex,  # type: ignore[arg-type]
            rank=rank,
            manifest=manifest,
            src=mem,
            dst=local,
            tiers=tiers,
            journal=journal,
            after=lambda m: _after_disk(tiers, local, m),
        ):
            done.append(step)
    if done and rank == 0:
        log.warning(
            "steps %s were only in the node-local memory tiers (replication stopped or failed); "
            "promoted to the %s tier",
            sorted(done),
            local.name,
        )
    return done


def _manifest(mem: Any, step: int, world: int) -> Manifest | None:
    """The step's manifest, or None: unreadable, or saved by another number of ranks (each rank
    copies what the saving rank of its number wrote, from its own node's tier: with fewer ranks
    some chunks are copied by nobody, with more a rank's number may now sit on another node;
    the replicator handles a step restored from peers, replication/replicate.py)."""
    try:
        manifest: Manifest = mem.store.load_manifest(step)
    except FlashCkptError as exc:
        log.warning("step %d in the memory tier: %s", step, exc)
        return None
    return manifest if manifest.world_size == world else None


def _after_disk(tiers: Any, local: Any, manifest: Manifest) -> None:
    """Rank 0, once the step is on disk: on to the remote (queued), then the disk retention."""
    try:
        tiers.committed(manifest.step, local, manifest)
        tiers.retain(local)
    except FlashCkptError as exc:
        log.warning("after promoting step %d to the %s tier: %s", manifest.step, local.name, exc)
