"""A clean ``close()`` under torch.distributed: the memory tier given back, as for one process.

The single-process rule (:mod:`flashckpt.engine.tiers.closing`: empty the memory tier when
every step in it is committed in a slower tier, else keep it and journal ``memory_kept``) is
applied here by the one rank that owns each memory tier, once every rank is done with it:

1. barrier ``ready``: every rank reached ``close()`` (its saves are durable, its replication
   thread stopped), so nobody writes into a memory tier any more. Each tier's owner deletes the
   parts (``steps/<s>.rank-<r>.json``) left in it: each is the orphan of a save whose rank was
   killed after writing it (in a node tier, no surviving rank can reach it);
2. a node-local tier (``replicas=1``): the steps only the node tiers hold are promoted to the
   disk tier first (:func:`~flashckpt.distributed.replication.stranded.promote_stranded`), so a
   step reported saved is never left where a lost node takes it;
3. barrier ``emptying``, then the owner empties: each node's leader its node tier, rank 0 the
   memory tier every rank shares (without replication). Nothing is emptied after SIGTERM
   (``handle_sigterm``), or with ``keep_memory_after_close=True``.

A rank that never arrives (it died) makes every step a :class:`~flashckpt.errors.
DistributedError` after ``dist_timeout_s``: the memory tier is then kept (``memory_kept``), so
the restart still finds it. Without a memory tier there is nothing to do and no barrier.
"""

from __future__ import annotations

import logging
from typing import Any

from flashckpt.distributed.replication.stranded import promote_stranded
from flashckpt.engine.tiers.closing import empty_memory_tier
from flashckpt.errors import DistributedError, FlashCkptError
from flashckpt.journal import Journal
from flashckpt.store.format.names import PART_RE, part_name
from flashckpt.store.store import CheckpointStore

log = logging.getLogger(__name__)


def close_tiers(
    runtime: Any, tiers: Any, journal: Journal, *, empty: bool, timeout_s: float | None
) -> float | None:
    """Steps 1-3 of the module docstring; returns what is left of ``timeout_s``."""
    mem = tiers.by_name("memory")
    if mem is None or len(tiers.tiers) < 2:
        return timeout_s
    ctx = runtime.ctx
    barrier = ctx.barrier("close")
    if timeout_s is not None:
        barrier.timeout_s = max(1.0, min(barrier.timeout_s, timeout_s))
    node_local = bool(runtime.node_local and getattr(mem, "node_local", False))
    owner = runtime.owns(mem)
    try:
        barrier.agree("ready", None)
        if owner:  # nobody writes a part now: any part left is an orphan of a killed save
            sweep_parts(mem.store, journal, tier=mem.name)
        if ctx.rank == 0 and not node_local:
            sweep_parts(tiers.tiers[1].store, journal, tier=tiers.tiers[1].name)
        if node_local:
            promote_stranded(barrier, rank=ctx.rank, tiers=tiers, journal=journal)
        if not empty:
            return timeout_s
        barrier.agree("emptying", None)
        if owner:
            timeout_s = empty_memory_tier(tiers, journal, timeout_s)
    except DistributedError as exc:
        journal.append("memory_kept", reason=f"the ranks did not close together: {exc}", steps=[])
        log.warning("memory tier kept at close: %s", exc)
    finally:
        ctx.finished(barrier)
    return timeout_s


def sweep_parts(store: CheckpointStore, journal: Journal, *, tier: str) -> None:
    """Delete every part (``steps/<s>.rank-<r>.json``) in ``store``: called once every rank is
    in ``close()``, when no save is in flight, so each one left is the orphan of a save whose
    rank was killed after writing it (in a node-local tier no surviving rank can reach it)."""
    try:
        names = store.part_names()
    except FlashCkptError as exc:
        log.warning("cannot list the parts in the %s tier: %s", tier, exc)
        return
    gone = []
    for name in names:
        m = PART_RE.match(name)
        if m is None or f"steps/{name}" != part_name(int(m[1]), int(m[2])):
            continue  # not under its canonical name: not ours to delete
        try:
            store.backend.delete(f"steps/{name}")
            gone.append(name)
        except FileNotFoundError:
            pass
        except OSError as exc:
            log.warning("could not delete the orphan part %s in the %s tier: %s", name, tier, exc)
    if gone:
        journal.append("orphan_parts_removed", tier=tier, parts=gone)
