"""At Checkpointer creation: do all ranks use the same root, and see the same directories?

The ranks commit one checkpoint together and rank 0 merges their parts, so every rank must open
the same root (the Store keys are derived from it, :mod:`flashckpt.distributed.group.context`) and
see the same directory for each local tier. Each rank first records its root under a key of the
process group (``flashckpt/<group>/root/<rank>``); then rank 0 drops a marker file in each tier
directory and the others look for it. A directory that is node-local on a multi-node run (a
memory tier in /dev/shm, a root on a local disk) is a ConfigError on every rank, here rather
than at the first save. With peer replication (``replicas=1``) the memory tier is node-local
by design: each node's leader (its lowest rank) marks it, and every rank must see its own
leader's mark and no other node's. Ranks that opened different roots never meet in one
barrier: after ``dist_timeout_s`` each of them reads the recorded roots and raises a
ConfigError naming them.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from flashckpt.distributed.group.context import DistContext
from flashckpt.distributed.group.nodes import NodeMap
from flashckpt.errors import ConfigError, DistributedError

NODE_LOCAL = frozenset({"memory"})  # tiers each node keeps for itself under replication


def check_shared(ctx: DistContext, dirs: Mapping[str, Path], nodes: NodeMap | None = None) -> None:
    """Raise ConfigError on every rank unless all ranks share the root and ``dirs``; with
    ``nodes`` (replication on) the memory tier must instead be shared within each node and by
    no two nodes."""
    roots_key = f"flashckpt/{ctx.group}/root"
    ctx.store.set(f"{roots_key}/{ctx.rank}", ctx.root.encode())
    barrier = ctx.barrier("shared-dirs")
    try:
        _markers(ctx, barrier, dirs, nodes)
    except DistributedError as exc:
        differ = _other_roots(ctx, roots_key)
        if differ:
            raise ConfigError(
                f"the ranks opened different checkpoint roots ({differ}): every rank must "
                "create its Checkpointer with the same root, on a filesystem every rank sees"
            ) from exc
        raise
    finally:
        ctx.finished(barrier)


def _other_roots(ctx: DistContext, roots_key: str) -> str:
    roots: dict[int, str] = {}
    for r in range(ctx.world_size):
        key = f"{roots_key}/{r}"
        if ctx.store.check([key]):
            roots[r] = bytes(ctx.store.get(key)).decode()
    if len(set(roots.values())) <= 1:
        return ""
    return "; ".join(f"rank {r}: {root}" for r, root in sorted(roots.items()))


def _markers(
    ctx: DistContext, barrier: Any, dirs: Mapping[str, Path], nodes: NodeMap | None
) -> None:
    """Rank 0 marks every shared directory; with ``nodes`` each node's leader marks the
    node-local ones (the memory tier), and every rank must see its own leader's mark there and
    no other node's."""
    local = {n for n in dirs if nodes is not None and n in NODE_LOCAL}
    writes = [n for n in dirs if n not in local] if ctx.rank == 0 else []
    if nodes is not None and nodes.is_leader(ctx.rank):
        writes += sorted(local)
    token, error = uuid.uuid4().hex if writes else "", None
    made: list[Path] = []
    try:
        for n in writes:
            made.append(dirs[n] / f".flashckpt-shared-{token}")
            made[-1].touch()
    except OSError as exc:
        error = f"rank {ctx.rank} cannot write a marker in {exc.filename}: {exc.strerror}"
    try:
        tokens = [v["token"] for v in barrier.exchange("mark", {"token": token, "error": error})]
        unseen, foreign = _look(ctx.rank, dirs, local, tokens, nodes)
        seen = barrier.exchange("look", {"unseen": unseen, "foreign": foreign, "error": error})
    finally:
        for m in made:
            try:
                os.unlink(m)
            except OSError:
                pass
    errors = [v["error"] for v in seen if v["error"]]
    if errors:
        raise ConfigError(errors[0])
    _refuse_unseen(seen, dirs, nodes)


def _look(
    rank: int,
    dirs: Mapping[str, Path],
    local: set[str],
    tokens: list[str],
    nodes: NodeMap | None,
) -> tuple[list[str], list[str]]:
    """(directories where this rank misses its writer's mark, node-local ones where it sees
    another node's)."""

    def marked(name: str, writer: int) -> bool:
        return (
            bool(tokens[writer]) and (dirs[name] / f".flashckpt-shared-{tokens[writer]}").exists()
        )

    unseen, foreign = [], []
    for name in dirs:
        if name not in local or nodes is None:
            if rank != 0 and not marked(name, 0):
                unseen.append(name)
            continue
        leader = nodes.local_leader(nodes.node_of(rank))
        if rank != leader and not marked(name, leader):
            unseen.append(name)
        if any(marked(name, w) for w in nodes.leaders() if w != leader):
            foreign.append(name)
    return unseen, foreign


def _refuse_unseen(
    seen: list[dict[str, Any]], dirs: Mapping[str, Path], nodes: NodeMap | None
) -> None:
    if nodes is not None:
        _refuse_node_local(seen, dirs, nodes)
    bad = {r: v["unseen"] for r, v in enumerate(seen) if v["unseen"]}
    if bad:
        what = "; ".join(
            f"rank {r} cannot see rank 0's {', '.join(f'{n} tier {dirs[n]}' for n in names)}"
            for r, names in bad.items()
        )
        raise ConfigError(
            f"checkpoint directories are not shared by all ranks ({what}). Under "
            "torch.distributed the root must be on a filesystem every rank sees, and a "
            "memory_tier (e.g. /dev/shm) is shared only by the ranks of one node: on "
            "multi-node runs give replicas=1 (each node keeps its own memory tier and a peer "
            "node a copy of it) or drop memory_tier="
        )


def _refuse_node_local(
    seen: list[dict[str, Any]], dirs: Mapping[str, Path], nodes: NodeMap
) -> None:
    foreign = {r: v["foreign"] for r, v in enumerate(seen) if v["foreign"]}
    if foreign:
        r, names = next(iter(foreign.items()))
        raise ConfigError(
            f"the {names[0]} tier {dirs[names[0]]} is shared by several nodes (rank {r} on "
            f"node {nodes.node_of(r)!r} sees another node's marker; nodes: {nodes.describe()}). "
            "With replicas=1 every node needs its own memory tier (a node-local /dev/shm); "
            "give Replication(placement=...) if the nodes are told apart wrongly"
        )
    unseen = {r: v["unseen"] for r, v in enumerate(seen) if set(v["unseen"]) & NODE_LOCAL}
    if unseen:
        r, names = next(iter(unseen.items()))
        name = sorted(set(names) & NODE_LOCAL)[0]
        leader = nodes.local_leader(nodes.node_of(r))
        raise ConfigError(
            f"the {name} tier {dirs[name]} is not shared within node {nodes.node_of(r)!r}: "
            f"rank {r} cannot see what rank {leader} (the node's leader) wrote there. Every "
            "rank of a node must use the same memory_tier directory on that node"
        )
