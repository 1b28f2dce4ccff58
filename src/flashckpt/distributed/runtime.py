"""What the Checkpointer calls when it runs under torch.distributed (one object, few hooks).

``Checkpointer`` holds a :class:`DistRuntime` (None outside torch.distributed) and calls:

1. ``begin_save(step)`` first thing in ``save()``: the attempt of this save
   (:mod:`flashckpt.distributed.attempt`); any exception ``save()`` raises before its job exists
   goes through ``failed(exc)``, which posts it so every rank raises the same error at once;
2. ``split(captured, state)`` after capture: validate DTensor placements, drop what other ranks
   write, rename per-rank tensors (:mod:`flashckpt.distributed.ownership`);
3. ``tier(tiers, nbytes)`` instead of ``TierSet.target``: rank 0 picks the tier for all ranks;
4. ``job(...)`` instead of building a plain ``SaveJob``: the job commits with the distributed
   protocol (:mod:`flashckpt.distributed.commit`);
5. ``restore(...)`` from ``restore()``: all ranks agree on the step
(:mod:`flashckpt.distributed.restore`).

With peer replication (``replicas=1``, :class:`~flashckpt.engine.options.Replication`) it also
knows every rank's node (:attr:`nodes`, :mod:`flashckpt.distributed.group.nodes`), owns the gloo
*side group* used only for replication traffic (:attr:`side_group`, created collectively in
:meth:`detect`) and the replication thread (:meth:`start` after the tiers exist, :meth:`stop` at
close). The memory tier is then node-local: each node's leader publishes the global manifest into it
(:mod:`flashckpt.distributed.commit`) and applies its retention.

**Using the side group from another thread** (restore-time chunk fetches on the training
thread): enter ``with runtime.side_channel() as group:``. It waits until the replication thread
has finished every step queued so far (all ranks queue the same steps, so on every rank the
group is then idle), keeps it from starting another round until the block ends, and yields the
group (None when replication is off or the group failed). Every rank must enter it, in the same
order as its other collectives on the group.
"""

from __future__ import annotations

import logging
import os
import threading
import warnings
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar

from flashckpt.distributed.attempt import SaveAttempt
from flashckpt.distributed.commit import DistSaveJob
from flashckpt.distributed.group.context import DistContext, agree_generation
from flashckpt.distributed.group.nodes import NodeMap, gather_nodes
from flashckpt.distributed.group.priority import with_background_priority
from flashckpt.distributed.group.shared import check_shared
from flashckpt.distributed.ownership import split_for_rank
from flashckpt.distributed.replication.peerrestore import peer_source
from flashckpt.distributed.restore import restore_agreed
from flashckpt.engine.options import Replication
from flashckpt.errors import ConfigError, DistributedError, FlashCkptError
from flashckpt.journal import Journal
from flashckpt.state.capture import Captured
from flashckpt.store.format.manifest import Manifest
from flashckpt.store.store import CheckpointStore

log = logging.getLogger(__name__)
T = TypeVar("T")


class DistRuntime:
    def __init__(
        self,
        ctx: DistContext,
        *,
        replication: Replication | None = None,
        nodes: NodeMap | None = None,
        side_group: Any = None,
    ) -> None:
        self.ctx = ctx
        self._per_rank: list[str] = []
        self._decided: tuple[int, str] | None = None
        self._attempt: SaveAttempt | None = None
        self.replication = replication  # None: off (or every rank on one node)
        self.nodes = nodes
        self.side_group = side_group  # gloo, replication traffic only (module docstring)
        self.side_lock = threading.RLock()  # held by a replication round or a side_channel()
        self.replicator: Any = None  # dist.replicate.Replicator once start() ran
        self._tiers: Any = None
        self._journal: Journal | None = None
        self._swept = False  # the stranded node-tier steps were promoted since the suspension

    @classmethod
    def detect(
        cls,
        *,
        process_group: Any = None,
        timeout_s: float = 300.0,
        on_busy: str = "wait",
        root: str | os.PathLike[str] = "",
        name: str | None = None,
        replication: Replication | None = None,
    ) -> DistRuntime | None:
        ctx = DistContext.detect(
            process_group=process_group, timeout_s=timeout_s, root=str(root), name=name
        )
        if ctx is None:
            if replication is not None:
                warnings.warn(
                    "replicas=1 has no effect without torch.distributed (one process, one "
                    "node): the memory tier is not replicated",
                    RuntimeWarning,
                    stacklevel=3,
                )
            return None
        if on_busy == "skip":
            raise ConfigError(
                "on_busy='skip' cannot be used under torch.distributed: ranks could skip "
                "different steps and wait for each other; use on_busy='wait'"
            )
        if replication is None:
            return cls(ctx)
        nodes = gather_nodes(ctx, replication.placement)
        if not nodes.multi_node:
            warnings.warn(
                f"replicas=1: every rank runs on node {nodes.nodes[0]!r}, so there is no other "
                "node to keep a replica; the memory tier is shared by the ranks as without "
                "replication (give Replication(placement=...) if the nodes were told apart "
                "wrongly)",
                RuntimeWarning,
                stacklevel=3,
            )
            return cls(ctx)
        nodes.check_ring()  # the same NodeMap on every rank: they all raise or none does
        # created from a thread of background priority: gloo's own threads inherit it
        group = with_background_priority(lambda: _side_group(process_group, replication.timeout_s))
        return cls(ctx, replication=replication, nodes=nodes, side_group=group)

    @property
    def rank(self) -> int:
        return self.ctx.rank

    @property
    def world_size(self) -> int:
        return self.ctx.world_size

    @property
    def lock_name(self) -> str:
        return f"rank-{self.ctx.rank}"

    def check_shared(self, dirs: Mapping[str, Path]) -> None:
        """Every rank must see the same directory for each local tier (``{tier: dir}``), but
        the memory tier under replication only within its node; see
        :func:`flashckpt.distributed.group.shared.check_shared`."""
        check_shared(self.ctx, dirs, self.nodes if self.replication is not None else None)

    def agree_generation(self, take: Callable[[], int]) -> int:
        """The run generation of this writer, rank 0's ``take()`` on every rank."""
        return agree_generation(self.ctx, take)

    # -- replication --------------------------------------------------------------------------
    @property
    def node_local(self) -> bool:
        """True when the memory tier is node-local (replication on, several nodes)."""
        return self.replication is not None and self.nodes is not None

    def owns(self, tier: Any) -> bool:
        """True on the one rank that sweeps, scrubs and empties ``tier``: its node's leader
        for a node-local memory tier (peer replication), rank 0 for a tier every rank shares."""
        if getattr(tier, "node_local", False) and self.nodes is not None:
            return self.nodes.is_leader(self.rank)
        return self.rank == 0

    def start(self, tiers: Any, journal: Journal) -> None:
        """After the tiers exist (``TierSet``): mark the memory tier node-local and start the
        replication thread (:mod:`flashckpt.distributed.replication.replicate`)."""
        self._tiers, self._journal = tiers, journal
        mem = tiers.by_name("memory")
        if not self.node_local or mem is None:
            return
        from flashckpt.distributed.replication.replicate import Replicator

        mem.node_local = True
        tiers.write_config()  # records node_local for ls / verify
        self.replicator = Replicator(self, tiers=tiers, memory=mem, journal=journal)
        mem.keep = self.replicator.retention(mem.keep)

    def stop(self) -> None:
        """Finish the replication round in progress (bounded) and stop the thread."""
        if self.replicator is not None:
            self.replicator.stop()

    def close_tiers(
        self, tiers: Any, journal: Journal, *, empty: bool, timeout_s: float | None
    ) -> float | None:
        """A clean close of every rank: what only node tiers hold goes to disk, then each memory
        tier's owner empties it (:mod:`flashckpt.distributed.closing`)."""
        from flashckpt.distributed.closing import close_tiers

        return close_tiers(self, tiers, journal, empty=empty, timeout_s=timeout_s)

    @contextmanager
    def side_channel(self) -> Iterator[Any]:
        """The side group for the training thread; see the module docstring."""
        if self.replicator is not None:
            self.replicator.drain()
        with self.side_lock:
            group = self.side_group
            if self.replicator is not None and self.replicator.broken:
                group = None
            yield group

    def verdict(self, step: int, *, stop: bool, save: Callable[[], bool]) -> str:
        """What every rank does after ``step``: "preempt" when rank 0 was signalled (``stop``
        on rank 0), else "save" or "skip" by rank 0's save policy (``save()``)."""
        return self.agreed(step, lambda: "preempt" if stop else ("save" if save() else "skip"))

    def agreed(self, step: int, decide: Callable[[], str]) -> str:
        """Rank 0's verdict for ``step`` (a short word: "save", "skip", "preempt") on every
        rank, for the decisions ranks could take differently: clock-based save policies, and
        SIGTERM arriving at each rank at its own step (ranks that save different steps wait
        for each other at the commit barrier until it times out). Rank 0 runs ``decide`` and
        posts the verdict in the c10d Store; the others wait for it (one Store round trip per
        step); the last reader deletes the key."""
        if self._decided is not None and self._decided[0] == step:
            return self._decided[1]  # asked twice for one step: the same answer
        store, key = self.ctx.store, f"{self.ctx.name}/should-save/{step}"
        if self.rank == 0:
            verdict = decide()
            store.set(key, verdict.encode())
        else:
            verdict = self._await_verdict(store, key, step)
            if store.add(f"{key}/read", 1) == self.world_size - 1:
                store.delete_key(key)
                store.delete_key(f"{key}/read")
        self._decided = (step, verdict)
        return verdict

    def _await_verdict(self, store: Any, key: str, step: int) -> str:
        """Rank 0's verdict for ``step``, waited for at most ``dist_timeout_s`` (the Store's
        own timeout is 30 minutes under torchrun): a :class:`DistributedError` saying so."""
        timeout_s = self.ctx.timeout_s
        try:
            store.wait([key], timedelta(seconds=timeout_s))
            return bytes(store.get(key)).decode()
        except Exception as exc:
            raise DistributedError(
                f"rank {self.rank} waited {timeout_s:g}s (dist_timeout_s) for rank 0's decision "
                f"whether to save step {step} ({type(exc).__name__}: {exc}); rank 0 crashed, "
                "hung, or calls should_save() for other steps than this rank. Every rank must "
                "call should_save() for every step; raise dist_timeout_s if rank 0 legitimately "
                "takes longer to reach a step",
                phase="should_save",
                ranks=[0],
            ) from exc

    # -- saving -------------------------------------------------------------------------------
    def run_save(self, step: int, save: Callable[[], T]) -> T:
        """``save()`` of ``step`` under the agreement: :meth:`begin_save` first, and any error
        of this rank (before or after its job exists) becomes the one every rank raises."""
        self.begin_save(step)
        try:
            return save()
        except Exception as exc:
            agreed = self.failed(exc)
            if agreed is exc:
                raise
            raise agreed from exc

    def begin_save(self, step: int) -> SaveAttempt:
        """The attempt of ``save(step)`` on this rank; call before anything that may raise."""
        self._attempt = SaveAttempt(self.ctx, step)
        return self._attempt

    def failed(self, exc: BaseException) -> BaseException:
        """What ``save()`` raises for ``exc`` raised before its job existed: the error every
        rank agrees on (this rank's cause attached), after removing what was written."""
        attempt = self._attempt
        if attempt is None:
            return exc
        self._attempt = None
        agreed = attempt.fail(exc, "preparing the save")
        attempt.cleanup()
        return agreed

    def split(self, captured: Captured, state: Mapping[str, Any]) -> None:
        self._per_rank = split_for_rank(
            captured, state, rank=self.ctx.rank, world_size=self.ctx.world_size
        )

    def tier(self, tiers: Any, nbytes: int) -> Any:
        """The tier of this save, chosen by rank 0 for every rank (phase ``plan``). The first
        save after any rank's replication stopped first promotes what only the node tiers
        hold (:mod:`flashckpt.distributed.replication.stranded`), on every rank together."""
        attempt = self._require_attempt()
        tier = attempt.plan(tiers, nbytes, swept=self._swept)
        if attempt.sweep and self._journal is not None:
            from flashckpt.distributed.replication.stranded import promote_stranded

            self._swept = True
            barrier = self.ctx.barrier("stranded", attempt.step)
            try:
                promote_stranded(barrier, rank=self.rank, tiers=tiers, journal=self._journal)
            except FlashCkptError as exc:  # the save goes on: close() tries again
                log.warning("promoting the steps only the node tiers hold: %s", exc)
            finally:
                self.ctx.finished(barrier)
        return tier

    def job(self, *, retain: Callable[[], object] | None, **kwargs: Any) -> DistSaveJob:
        attempt = self._require_attempt()
        tier = kwargs.get("tier")
        published: Callable[[Manifest], None] | None = None
        if self.node_local and getattr(tier, "node_local", False):
            # each node leader trims its own tier; the replicator promotes to the disk tier
            retain = (lambda: self._tiers.retain(tier)) if self._tiers is not None else None
            if self.replicator is not None:
                published = self.replicator.published
        job = DistSaveJob(
            attempt=attempt,
            per_rank=self._per_rank,
            retain=retain,
            nodes=self.nodes,
            published=published,
            **kwargs,
        )
        self._attempt = None  # from here on the job posts its failures
        return job

    def _require_attempt(self) -> SaveAttempt:
        if self._attempt is None:
            raise RuntimeError("DistRuntime.begin_save() must come first")  # a flashckpt bug
        return self._attempt

    def restore(
        self,
        store: CheckpointStore,
        journal: Journal,
        state: Mapping[str, Any],
        *,
        step: int | None,
        steps: list[int],
        load: Callable[[int], Any],
        load_tier: Callable[[int, Any], object] | None = None,
        damaged: set[int] | None = None,
    ) -> int | None:
        """``steps``: the steps this rank can see (rank 0's list decides);
        ``load(step)`` loads one step into ``state`` on this rank, ``load_tier(step, tier)``
        from one tier (a node-local memory tier first restores from peers:
        distributed/peerrestore)."""

        bad: set[int] = damaged if damaged is not None else set()

        def on_corrupt(cand: int, msg: str) -> None:
            warnings.warn(f"skipping damaged checkpoint step {cand}: {msg}", stacklevel=4)
            journal.append("corrupt", step=cand, tier="local", error=msg)
            bad.add(cand)  # damaged for every rank: a later save of it replaces it

        peer = None
        if self.node_local and self.nodes is not None and load_tier is not None:
            found = peer_source(
                tiers=self._tiers,
                leader=self.nodes.is_leader(self.rank),
                node=self.nodes.node_of(self.rank),
                channel=self.side_channel,
                journal=journal,
                load_tier=load_tier,
                replicator=self.replicator,
            )
            if found is not None:
                peer, load = found
        try:
            return restore_agreed(
                self.ctx,
                store,
                step=step,
                steps=steps,
                load=load,
                on_corrupt=on_corrupt,
                state=state,
                peer=peer,
            )
        finally:  # published in the node tiers, but no node can assemble it: like damage
            if peer is not None:
                bad |= peer.unassemblable


def _side_group(process_group: Any, timeout_s: float) -> Any:
    """A new gloo group over the ranks of ``process_group`` (all ranks call this together)."""
    import torch.distributed as dist

    timeout = timedelta(seconds=timeout_s)
    if process_group is None:
        return dist.new_group(backend="gloo", timeout=timeout)
    ranks = dist.get_process_group_ranks(process_group)
    return dist.new_group(
        ranks=ranks, backend="gloo", timeout=timeout, use_local_synchronization=True
    )
