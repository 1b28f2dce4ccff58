"""Restore from the memory tiers of the surviving nodes (peer replication, ``replicas>=1``).

With replication the memory tier is node-local: each node's tier holds its ranks' chunks and
the replicas of its peer node's, and a node that was replaced has an empty one. Before the
disk or remote tier is touched, every rank takes these steps together
(:func:`restore_from_peers`, called by :func:`flashckpt.distributed.restore.restore_agreed`):

1. **Which step**: every rank posts the steps its node's memory tier holds, rank 0 also those
   of the slower (shared) tiers. The candidates are the steps some node holds that are no older
   than the newest step of a slower tier (or just the requested step), newest first: a step the
   nodes cannot assemble never makes the restore take an older one than the disk holds.
2. **Can it be assembled**: the lowest rank holding the candidate's manifest broadcasts it over
   the gloo side group; each rank names the chunks its restore reads (its restore plan) and
   the ranks exchange what their tiers lack and hold
   (:func:`flashckpt.distributed.replication.peerfetch.plan_fetch`: real presence, not markers). A
   chunk no node holds: every rank journals ``peer_restore_skipped`` (step, why) and tries the next
   older candidate.
3. **Fetch**: the chunks each node lacks come from the peers (verified,
   :func:`~flashckpt.distributed.replication.peerfetch.run_fetch`); each node's leader writes the
   manifest into its own tier if it lacks it. Every rank posts how that went (Store barrier): a
   failure on any rank (a peer died, damage everywhere, a full tier) sends every rank to the disk
   and remote tiers together, before any byte reached the live state.
4. **Load**: every rank loads the step from its own node's tier through the normal reader
   (verified as always), then posts the outcome: all good, ``restored_from_peers`` is journaled
   (bytes fetched, seconds); otherwise every rank falls back together (the fallback then
   overwrites what was loaded, or the restore raises:
   :class:`flashckpt.engine.restore.load.Attempt`).

No chunk or manifest of the disk tier is read on this path.
"""

from __future__ import annotations

import logging
import time
import warnings
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from flashckpt.distributed.group.barrier import StoreBarrier
from flashckpt.distributed.replication.nodelineage import drop_abandoned, not_live
from flashckpt.distributed.replication.peerfetch import (
    FetchStats,
    broadcast_bytes,
    plan_fetch,
    run_fetch,
    tier_identity,
)
from flashckpt.errors import FlashCkptError
from flashckpt.journal import Journal
from flashckpt.state.restore import plan_restore
from flashckpt.store.format.lineage import LEGACY
from flashckpt.store.format.manifest import ChunkRef, Manifest
from flashckpt.store.format.parse import parse_manifest
from flashckpt.store.lineage import copy_lineage
from flashckpt.store.store import CheckpointStore, step_name

log = logging.getLogger(__name__)


@dataclass(kw_only=True)
class PeerSource:
    """This rank's node-local memory tier and how the restore uses it."""

    store: CheckpointStore
    tier: str  # tier_identity() of its directory: ranks sharing the tier report the same
    leader: bool  # this rank writes the node's manifest (the lowest rank of its node)
    node: str = ""  # the node's name (journaled with the copies its leader removes)
    channel: Callable[[], AbstractContextManager[Any]]  # the gloo side group, while idle
    load: Callable[[int], object]  # load a step from this node's tier into the live state
    journal: Journal
    # told when the side group failed under a fetch (gloo groups do not recover): replication
    # stops instead of waiting on a broken group
    broken: Callable[[BaseException], None] | None = None
    # told (on every rank) which step was loaded from the node tiers: it may exist nowhere
    # else, so the replicator queues it for the disk tier (distributed/replication/replicate.py,
    # distributed/replication/nodepromote.py)
    restored: Callable[[int], None] | None = None
    # the steps the slower tiers hold (asked on rank 0 only: they are shared); None: unknown,
    # the candidates are then bounded by the steps some rank sees only outside the memory tier
    slower_steps: Callable[[], list[int]] | None = None
    # the lineage of each copy the slower tiers hold (rank 0 only), for the judge: a node
    # tier's copy of an abandoned branch (a requeued job back on the node where an earlier
    # attempt died) is never a candidate (store/lineage.py)
    slower_lineage: Callable[[], list[tuple[int, Any]]] | None = None
    # steps published in the node tiers that no node can assemble any more (a chunk is on no
    # node's tier: its node was lost before the step was replicated): handled like damaged
    # ones, so a later save of that step number replaces them (engine/save/steps.py)
    unassemblable: set[int] = field(default_factory=set)
    # on the leader: delete steps from the node tier (copies lineage abandoned, removed after
    # every rank posted: distributed/replication/nodelineage.py); None: journal them only
    drop: Callable[[list[int]], None] | None = None


def peer_source(
    *,
    tiers: Any,
    leader: bool,
    node: str = "",
    channel: Callable[[], AbstractContextManager[Any]],
    journal: Journal,
    load_tier: Callable[[int, Any], object],
    replicator: Any = None,
) -> tuple[PeerSource, Callable[[int], Any]] | None:
    """The peer source of a Checkpointer whose memory tier is node-local (else None), and the
    load of the fallback path: the slower tiers only (a node's tier lacks other nodes' chunks,
    which is no damage). ``load_tier(step, tier)`` loads one step from one tier;
    ``replicator``: the :class:`~flashckpt.distributed.replication.replicate.Replicator` (its
    ``broke`` and ``restored``), if any."""
    mem = tiers.by_name("memory")
    if mem is None or mem.path is None or not getattr(mem, "node_local", False):
        return None
    source = PeerSource(
        store=mem.store,
        tier=tier_identity(mem.path),
        leader=leader,
        node=node,
        channel=channel,
        load=lambda s: load_tier(s, mem),
        journal=journal,
        broken=replicator.broke if replicator is not None else None,
        restored=replicator.restored if replicator is not None else None,
        drop=(lambda steps: tiers.drop(mem, steps)) if leader else None,
    )
    slower = [t for t in tiers.tiers if t is not mem]
    source.slower_steps = lambda: sorted({s for t in slower for s in _steps(t)})
    source.slower_lineage = lambda: _lineages(
        [(t.store, s) for t in slower for s in _steps(t)], name="slower tiers"
    )

    def fallback(s: int) -> Any:
        return tiers.restore(s, [t for t in slower if _holds(t, s)], partial(load_tier, s))

    return source, fallback


def _holds(tier: Any, step: int) -> bool:
    return step in _steps(tier)


def _steps(tier: Any) -> list[int]:
    try:
        return list(tier.store.steps())
    except FlashCkptError as exc:
        log.warning("cannot list the %s tier: %s", tier.name, exc)
        return []


def restore_from_peers(
    barrier: StoreBarrier,
    rank: int,
    peer: PeerSource,
    step: int | None,
    values: list[dict[str, Any]],
    prepare: Callable[[], None],
    state: Mapping[str, Any],
) -> int | None:
    """The step loaded from the nodes' memory tiers, or None: every rank takes the disk and
    remote path then (module docstring). ``values``: every rank's ``candidates`` post;
    ``prepare()`` runs before a restore plan is made (optimizer state, distributed/restore.py)."""
    with peer.channel() as group:
        mem = _memory_steps(peer.store)
        slow = peer.slower_steps() if rank == 0 and peer.slower_steps is not None else None
        slow_lin = peer.slower_lineage() if rank == 0 and peer.slower_lineage else None
        lin = _lineages([(peer.store, s) for s in mem], name="memory tier")
        post = {"ok": group is not None, "mem": mem, "slow": slow, "lin": lin, "slow_lin": slow_lin}
        ready = barrier.exchange("peer-ready", post)
        if peer.leader:  # every rank posted: nobody reads its node's abandoned copies now
            drop_abandoned(ready, rank, node=peer.node, journal=peer.journal, drop=peer.drop)
        if not all(v.get("ok") for v in ready):
            down = [r for r, v in enumerate(ready) if not v.get("ok")]
            peer.journal.append("peer_restore_skipped", reason=f"no side group on ranks {down}")
            return None
        for cand in peer_candidates(step, ready, values):
            got = _try_step(barrier, group, rank, peer, cand, ready, prepare, state)
            if got != "next":
                return cand if got == "loaded" else None
    return None


def peer_candidates(
    step: int | None, ready: list[dict[str, Any]], values: list[dict[str, Any]]
) -> list[int]:
    """Steps to try from the memory tiers, newest first (module docstring, step 1); a step
    any node tier holds a copy of an abandoned or superseded branch of is none of them."""
    mem = {int(s) for v in ready for s in v["mem"]} - not_live(ready)
    if step is not None:
        return [step] if step in mem else []
    slow = ready[0].get("slow")
    if slow is not None:  # rank 0 listed the slower tiers: try no step older than theirs
        floor = max((int(s) for s in slow), default=-1)
        return sorted((s for s in mem if s >= floor), reverse=True)
    slower = {int(s) for v in values for s in v["steps"]} - mem
    floor = max(slower, default=-1)
    return sorted((s for s in mem if s > floor), reverse=True)


def _lineages(copies: list[tuple[CheckpointStore, int]], *, name: str) -> list[tuple[int, Any]]:
    """``[(step, lineage as JSON or None: unreadable)]`` of each copy (read from its head)."""
    out: list[tuple[int, Any]] = []
    for store, s in copies:
        lin = copy_lineage(store, s)
        out.append((s, None if lin is None else "legacy" if lin == LEGACY else lin.to_json()))
    return out


def _memory_steps(store: CheckpointStore) -> list[int]:
    try:
        return store.steps()
    except FlashCkptError as exc:
        log.warning("cannot list the memory tier %s: %s", store.url, exc)
        return []


def _try_step(
    barrier: StoreBarrier,
    group: Any,
    rank: int,
    peer: PeerSource,
    cand: int,
    ready: list[dict[str, Any]],
    prepare: Callable[[], None],
    state: Mapping[str, Any],
) -> str:
    """ "loaded", "next" (the step cannot be assembled from peers) or "fallback"."""
    t0 = time.perf_counter()
    src = min(r for r, v in enumerate(ready) if cand in v["mem"])
    have_manifest = cand in ready[rank]["mem"]
    window = peer.store.liveness.open_window(kind="peer-restore", step=cand)
    ok = False
    try:
        got, failure = _plan(group, peer, cand, src, rank, state, prepare, window)
        # a stall or a kill under the gloo exchange (manifest, plan) must not escape as a raw
        # gloo error on some ranks: every rank posts how planning went, and all fall back
        planned = barrier.exchange(f"peer-plan-{cand}", {"ok": not failure, "error": failure})
        if not _all_ok(peer, planned, cand, "planning"):
            return "fallback"
        if got is None:
            return "next"  # every rank got the same bytes: the same verdict everywhere
        manifest, plan = got
        if not plan.errors and plan.unheld():
            reason = f"{len(plan.unheld())} chunk(s) it needs are on no node's memory tier"
            peer.journal.append("peer_restore_skipped", step=cand, reason=reason)
            peer.unassemblable.add(cand)
            return "next"  # every rank saw the same plan: the same verdict everywhere
        stats, failure = _fetch(group, peer, plan, manifest, cand, have_manifest)
        fetched = barrier.exchange(f"peer-fetch-{cand}", {"ok": not failure, "error": failure})
        if not _all_ok(peer, fetched, cand, "fetching"):
            return "fallback"
        ok = True
    finally:
        window.committed() if ok else window.failed()
    return _load(barrier, peer, cand, stats, t0)


def _plan(
    group: Any,
    peer: PeerSource,
    cand: int,
    src: int,
    rank: int,
    state: Mapping[str, Any],
    prepare: Callable[[], None],
    window: Any,
) -> tuple[tuple[Manifest, Any] | None, str]:
    """Steps 2 of the module docstring on this rank: the candidate's manifest (shared over the
    side group) and the fetch plan; None when no rank can read the manifest. The second value
    is this rank's failure: the side group failed (a peer stalled past its timeout or died: it
    is broken for good) or planning raised."""
    try:
        manifest = _shared_manifest(group, peer.store, cand, src, rank)
        if manifest is None:
            return None, ""
        refs, error = _needs(manifest, state, rank, prepare)
        plan = plan_fetch(group, peer.store, refs, tier=peer.tier, error=error, window=window)
    except Exception as exc:
        if not isinstance(exc, FlashCkptError) and peer.broken is not None:
            peer.broken(exc)  # the transport failed: the side group is unusable from now on
        return None, f"{type(exc).__name__}: {exc}"
    return (manifest, plan), ""


def _shared_manifest(
    group: Any, store: CheckpointStore, cand: int, src: int, rank: int
) -> Manifest | None:
    data = b""
    if rank == src:
        try:
            data = store.backend.read(step_name(cand))
        except (OSError, FlashCkptError) as exc:
            log.warning("cannot read step %d from the memory tier %s: %s", cand, store.url, exc)
    data = broadcast_bytes(group, data, src)
    if not data:
        return None
    try:
        manifest = parse_manifest(data, where=f"step {cand} in the memory tier of rank {src}")
    except FlashCkptError as exc:
        log.warning("step %d in the memory tier of rank %d: %s", cand, src, exc)
        return None
    return manifest if manifest.step == cand else None


def _needs(
    manifest: Manifest, state: Mapping[str, Any], rank: int, prepare: Callable[[], None]
) -> tuple[list[ChunkRef], str]:
    """The chunks this rank's restore of ``manifest`` reads (every shard of every planned
    tensor: what the loader checks is present before it reads), or why it cannot say."""
    try:
        prepare()
        plan = plan_restore(state, manifest, strict=False, rank=rank)
    except Exception as exc:
        return [], f"{type(exc).__name__}: {exc}"
    indices = {
        ext.chunk
        for target in plan.targets.values()
        for shard in target.entry.shards
        for ext in shard.extents
    }
    return [manifest.chunks[i] for i in sorted(indices)], ""


def _fetch(
    group: Any, peer: PeerSource, plan: Any, manifest: Manifest, cand: int, have_manifest: bool
) -> tuple[FetchStats | None, str]:
    try:
        stats = run_fetch(group, peer.store, plan, step=cand, journal=peer.journal)
        if peer.leader and not have_manifest:  # a replacement node: its tier gets the step
            hashes = sorted(manifest.chunk_hashes())
            peer.store.commit(manifest, chunk_dirs=peer.store.chunk_dirs(hashes))
    except Exception as exc:  # a dead peer (gloo), damage everywhere, a full tier
        if not isinstance(exc, FlashCkptError) and peer.broken is not None:
            peer.broken(exc)  # the transport failed: the side group is unusable from now on
        return None, f"{type(exc).__name__}: {exc}"
    return stats, ""


def _all_ok(peer: PeerSource, values: list[dict[str, Any]], cand: int, what: str) -> bool:
    failed = {r: v.get("error", "") for r, v in enumerate(values) if not v.get("ok")}
    if not failed:
        return True
    detail = "; ".join(f"rank {r}: {e}" for r, e in sorted(failed.items()))
    msg = f"restore of step {cand} from peers failed {what} ({detail}); every rank falls back"
    warnings.warn(msg + " to the disk and remote tiers", RuntimeWarning, stacklevel=5)
    peer.journal.append("peer_restore_failed", step=cand, phase=what, error=detail)
    return False


def _load(
    barrier: StoreBarrier, peer: PeerSource, cand: int, stats: FetchStats | None, t0: float
) -> str:
    error = ""
    try:
        peer.load(cand)
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
    values = barrier.exchange(f"peer-load-{cand}", {"ok": not error, "error": error})
    if not _all_ok(peer, values, cand, "loading"):
        return "fallback"
    got = stats or FetchStats(rank=-1)
    peer.journal.append(
        "restored_from_peers",
        step=cand,
        bytes=got.received_bytes,
        chunks=got.received_chunks,
        sent_bytes=got.sent_bytes,
        sources={str(r): n for r, n in sorted(got.sources.items())},
        seconds=time.perf_counter() - t0,
        fetch_seconds=got.seconds,
    )
    return "loaded"
