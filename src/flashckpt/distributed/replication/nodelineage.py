"""Lineage across the node tiers (peer replication): which copies are the checkpoint, and the
removal of the others by the node that owns each tier.

At a restore every rank posts the lineage of each copy its node's memory tier holds, rank 0
also those of the slower (shared) tiers (:mod:`flashckpt.distributed.replication.peerrestore`,
phase ``peer-ready``). :func:`judge_posts` judges them all together
(:func:`flashckpt.store.lineage.judge`: one rule for every tier): a node's own view (its tier
and the disk) can call a copy abandoned that another node's newer branch keeps live, so only
the verdict over every post is acted on.

:func:`drop_abandoned` runs on each node's leader (the lowest rank of the node: the one rank
that publishes into the node tier and applies its retention, :mod:`flashckpt.distributed.
group.nodes`) after every rank posted, so no rank of the node is still reading those copies:
each copy of its tier the verdict drops (abandoned or superseded) is journaled
``abandoned_copy`` (with ``node``) and deleted through :meth:`~flashckpt.engine.tiers.tierset.
TierSet.drop` (its chunks are then collected by gc: liveness stays the owner). The restore
never tries these copies (:func:`not_live`).
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable
from typing import Any

from flashckpt.errors import FlashCkptError
from flashckpt.journal import Journal
from flashckpt.store.format.lineage import LEGACY, parse_lineage
from flashckpt.store.lineage import LIVE, Copy, Judgement, judge

log = logging.getLogger(__name__)


def judge_posts(ready: list[dict[str, Any]]) -> Judgement[tuple[int, int]]:
    """The verdict on every posted copy: ``where`` is ``(rank, index in its post)``, rank -1
    for rank 0's post of the slower tiers (``slow_lin``)."""
    copies: list[Copy[tuple[int, int]]] = []
    posts = [(r, v.get("lin")) for r, v in enumerate(ready)] + [(-1, ready[0].get("slow_lin"))]
    for r, rows in posts:
        for i, (s, lin) in enumerate(rows or ()):
            try:
                parsed = (
                    None
                    if lin is None
                    else LEGACY
                    if lin == "legacy"
                    else parse_lineage(lin, "post")
                )
            except FlashCkptError:
                parsed = None
            copies.append(Copy(step=int(s), where=(r, i), order=0 if r >= 0 else 1, lineage=parsed))
    return judge(copies)


def not_live(ready: list[dict[str, Any]]) -> set[int]:
    """Steps of which some node tier's copy is not on the live branch."""
    verdict = judge_posts(ready)
    return {c.step for c, v in verdict.verdicts.items() if v != LIVE and c.where[0] >= 0}


def drop_abandoned(
    ready: list[dict[str, Any]],
    rank: int,
    *,
    node: str,
    journal: Journal,
    drop: Callable[[list[int]], None] | None,
) -> list[int]:
    """On a node's leader ``rank``: journal and remove (``drop(steps)``; None: only journal)
    the copies of its node tier that the verdict over every post drops; returns their steps."""
    verdict = judge_posts(ready)
    mine = [c for c in verdict.dropped if c.where[0] == rank]
    for c in mine:
        journal.append(
            "abandoned_copy",
            step=c.step,
            tier="memory",
            node=node,
            generation=c.lineage.generation if c.lineage is not None else None,
            newest_generation=verdict.newest,
            verdict=verdict.verdicts[c],
            removed=drop is not None,
        )
    steps = sorted({c.step for c in mine})
    if not steps:
        return []
    msg = (
        f"{len(steps)} checkpoint copies in the memory tier of node {node!r} are on a branch the "
        f"newest run (generation {verdict.newest}) abandoned or replaced, so they are not "
        f"restored: steps {steps}" + ("; removed from that tier" if drop is not None else "")
    )
    warnings.warn(msg, RuntimeWarning, stacklevel=4)
    log.warning(msg)
    if drop is not None:
        try:
            drop(steps)
        except FlashCkptError as exc:  # skipped anyway; the next restore tries again
            log.warning(
                "could not remove the abandoned copies %s from node %s: %s", steps, node, exc
            )
    return steps
