"""Which node every rank runs on, and which rank keeps whose replica (peer replication).

Each rank names its node once, when its Checkpointer is created, and the names are all-gathered
through the c10d Store (a :class:`~flashckpt.distributed.group.barrier.StoreBarrier` phase, so a
rank that never arrives is the usual :class:`~flashckpt.errors.DistributedError` naming it):

1. ``placement(rank)`` when the user gave one (any string; ranks with equal strings share a node);
2. else torchrun's ``GROUP_RANK`` (the node rank of ``--node-rank``), as ``node-<GROUP_RANK>``;
3. else the host name.

:class:`NodeMap` answers the questions replication and the node-local commit ask: the node of a
rank, the ranks on a node, its *local leader* (lowest rank: it writes the node's copy of the
global manifest and applies the node tier's retention) and ``peer_of(rank)``: a ring over the
nodes (sorted by their lowest rank), the rank with the same local index on the next node.
Without a placement, nodes must hold equal numbers of ranks (a ring of unequal nodes would make
some ranks keep two replicas and others none); with one, the local index wraps around.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from flashckpt.distributed.group.barrier import raise_failed
from flashckpt.distributed.group.context import DistContext
from flashckpt.errors import ConfigError

Placement = Callable[[int], str]


def node_label(rank: int, placement: Placement | None = None) -> str:
    """This rank's node name (module docstring, rules 1-3)."""
    if placement is not None:
        label = placement(rank)
        if not isinstance(label, str) or not label:
            raise ConfigError(
                f"placement({rank}) returned {label!r}; it must return a non-empty string "
                "naming the node of the rank (ranks with the same string share a node)"
            )
        return label
    group = os.environ.get("GROUP_RANK")
    if group is not None and group.strip().isdigit():
        return f"node-{int(group)}"
    return socket.gethostname()


@dataclass(frozen=True)
class NodeMap:
    """The node of every rank (``labels[rank]``); ``placed``: a placement function chose them."""

    labels: tuple[str, ...]
    placed: bool = False
    _order: tuple[str, ...] = field(init=False, repr=False, compare=False)
    _ranks: dict[str, tuple[int, ...]] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        ranks: dict[str, list[int]] = {}
        for r, label in enumerate(self.labels):
            ranks.setdefault(label, []).append(r)
        order = tuple(sorted(ranks, key=lambda n: ranks[n][0]))
        object.__setattr__(self, "_order", order)
        object.__setattr__(self, "_ranks", {n: tuple(rs) for n, rs in ranks.items()})

    @classmethod
    def of(cls, labels: Sequence[str], *, placed: bool = False) -> NodeMap:
        return cls(tuple(labels), placed)

    @property
    def nodes(self) -> tuple[str, ...]:
        """Node names, ordered by their lowest rank."""
        return self._order

    @property
    def multi_node(self) -> bool:
        return len(self._order) > 1

    def node_of(self, rank: int) -> str:
        return self.labels[rank]

    def ranks_on(self, node: str) -> tuple[int, ...]:
        return self._ranks[node]

    def local_leader(self, node: str) -> int:
        """The lowest rank on ``node``."""
        return self._ranks[node][0]

    def is_leader(self, rank: int) -> bool:
        return self.local_leader(self.node_of(rank)) == rank

    def leaders(self) -> list[int]:
        """The local leader of every node, in node order."""
        return [self._ranks[n][0] for n in self._order]

    def peer_of(self, rank: int) -> int:
        """The rank keeping ``rank``'s replica: same local index on the next node (a ring)."""
        self.check_ring()
        node = self.node_of(rank)
        here = self._ranks[node]
        nxt = self._ranks[self._order[(self._order.index(node) + 1) % len(self._order)]]
        return nxt[here.index(rank) % len(nxt)]

    def sources_of(self, rank: int) -> list[int]:
        """The ranks whose replica ``rank`` keeps (one each on a balanced ring)."""
        return [r for r in range(len(self.labels)) if r != rank and self.peer_of(r) == rank]

    def check_ring(self) -> None:
        """Raise ConfigError unless a ring of peers on other nodes exists."""
        if len(self._order) < 2:
            raise ConfigError(
                "peer replication needs ranks on at least two nodes, but every rank runs on "
                f"node {self._order[0]!r}; use replicas=0 on one node"
            )
        sizes = {len(rs) for rs in self._ranks.values()}
        if len(sizes) > 1 and not self.placed:
            what = ", ".join(f"{n}: {len(self._ranks[n])}" for n in self._order)
            raise ConfigError(
                f"the nodes run unequal numbers of ranks ({what}), so a ring of peers would "
                "leave some ranks without a replica; start the same number of ranks per node, "
                "or give replicas=Replication(placement=...) to say which ranks share a node"
            )

    def describe(self) -> str:
        return "; ".join(f"{n}: ranks {list(self._ranks[n])}" for n in self._order)


def gather_nodes(ctx: DistContext, placement: Placement | None = None) -> NodeMap:
    """Every rank's node, all-gathered through the Store (one barrier phase)."""
    barrier = ctx.barrier("nodes")
    error, label = None, ""
    try:
        label = node_label(ctx.rank, placement)
    except Exception as exc:
        error = f"naming its node: {type(exc).__name__}: {exc}"
    try:
        values = barrier.exchange("nodes", {"ok": error is None, "error": error, "node": label})
        raise_failed(values, phase="nodes")
    finally:
        ctx.finished(barrier)
    return NodeMap.of([str(v["node"]) for v in values], placed=placement is not None)
