"""Choosing the copy of each step by lineage (the rule is store/lineage.py's), and this
writer's own lineage.

:class:`Branch` is one writer's lineage: its run generation (taken once when it opened the
root) and its branch point, set by its ``restore()`` (the step it returned, or a fresh start
when it found nothing) and fixed at its first save; a writer that never restored records an
unknown branch point, which abandons nothing.

:func:`judged_holders` is what restore reads instead of tier order: every tier's copies, judged
(:func:`flashckpt.store.lineage.judge`); a copy on an abandoned branch (or superseded by a
newer generation's copy of the same step) is skipped, journaled ``abandoned_copy`` and, in the
memory tier this writer owns, deleted through the store (its chunks are then collected by gc:
liveness stays the owner). Disk, remote and tiers of other writers are never touched. A
node-local memory tier (peer replication) is judged together with every other node's at the
distributed restore and swept by its node's leader (distributed/replication/nodelineage.py):
its copies are skipped here, not journaled twice.
"""

from __future__ import annotations

import logging
import threading
import warnings
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from flashckpt.errors import FlashCkptError
from flashckpt.journal import Journal
from flashckpt.store.format.lineage import Lineage
from flashckpt.store.generation import take_generation
from flashckpt.store.lineage import Judgement, judge_held, newest_recorded
from flashckpt.store.store import CheckpointStore

if TYPE_CHECKING:
    from flashckpt.engine.tiers.build import Tier
    from flashckpt.engine.tiers.tierset import TierSet

log = logging.getLogger(__name__)


class Branch:
    """One writer's lineage (see the module docstring); thread-safe."""

    def __init__(self, generation: int) -> None:
        self.generation = generation
        self._parent: tuple[int, int] | None = None  # (generation, step); step -1: fresh
        self._frozen: Lineage | None = None
        self._lock = threading.Lock()

    def restored(self, step: int | None, generation: int | None) -> None:
        """``restore()`` returned ``step`` of ``generation`` (``step`` None: it found nothing;
        ``generation`` None: unknown, so the branch point stays unknown). Ignored once a save
        fixed the lineage: one generation has one branch point."""
        with self._lock:
            if self._frozen is not None:
                return
            if step is None:
                self._parent = (self.generation - 1, -1)
            elif generation is None:  # loaded from where no lineage was read (a peer's tier)
                self._parent = None  # unknown: abandons nothing
            else:
                self._parent = (min(generation, self.generation - 1), step)

    def lineage(self) -> Lineage:
        """The lineage of this writer's manifests (fixed by the first call)."""
        with self._lock:
            if self._frozen is None:
                pgen, pstep = self._parent or (self.generation - 1, None)
                self._frozen = Lineage(
                    generation=self.generation, parent_generation=pgen, parent_step=pstep
                )
            return self._frozen


class AgreesGeneration(Protocol):
    """distributed/runtime.py's DistRuntime: rank 0 takes the generation for every rank."""

    def agree_generation(self, take: Callable[[], int]) -> int: ...


def open_branch(root: Path, store: CheckpointStore, dist: AgreesGeneration | None) -> Branch:
    """The lineage of a writer opening ``root`` (its writer lock held): a new generation
    (store/generation.py), the same on every rank under torch.distributed."""
    take = partial(take_generation, root, floor=partial(newest_recorded, store))
    return Branch(dist.agree_generation(take) if dist is not None else take())


def owned_memory(tiers: TierSet, rank: int | None) -> Tier | None:
    """The memory tier a writer may remove abandoned copies from: its own; under
    torch.distributed (``rank`` not None) the one every rank shares, by rank 0 only; a node
    tier under peer replication by its node's leader at the distributed restore, not here."""
    mem = tiers.by_name("memory")
    if mem is None or mem.node_local or (rank is not None and rank != 0):
        return None
    return mem


def judged_holders(
    tiers: TierSet, journal: Journal, *, owned: Tier | None
) -> tuple[dict[int, list[Tier]], Judgement[tuple[int, int]]]:
    """``{step: tiers holding its checkpoint, best first}`` by lineage (never by tier order
    alone), and the judgement; the copies dropped are journaled and removed from ``owned``."""
    held = tiers.holders()  # fastest tier first (engine/tiers/tierset.py)
    live, verdict = judge_held(held, lambda t: t.store)
    doomed: list[int] = []
    said: list[str] = []
    for c in verdict.dropped:
        tier = held[c.step][c.where[1]]
        if tier.node_local:  # judged with every node's tier, journaled and removed by its node
            continue  # (distributed/replication/nodelineage.py)
        remove = owned is not None and tier is owned
        gen = c.lineage.generation if c.lineage is not None else None
        said.append(f"step {c.step} in the {tier.name} tier (generation {gen})")
        journal.append(
            "abandoned_copy",
            step=c.step,
            tier=tier.name,
            generation=gen,
            newest_generation=verdict.newest,
            verdict=verdict.verdicts[c],
            removed=remove,
        )
        if remove:
            doomed.append(c.step)
    if said:
        msg = (
            f"{len(said)} checkpoint copies are on a branch the newest run (generation "
            f"{verdict.newest}) abandoned or replaced, so they are not restored: "
            + ", ".join(said)
            + (f"; removed from {owned.url} (this run's memory tier)" if doomed and owned else "")
        )
        warnings.warn(msg, RuntimeWarning, stacklevel=4)
        log.warning(msg)
    if doomed and owned is not None:
        try:
            tiers.drop(owned, doomed)
        except FlashCkptError as exc:  # skipped anyway; the next restore tries again
            log.warning("could not remove the abandoned copies %s: %s", doomed, exc)
    return live, verdict
