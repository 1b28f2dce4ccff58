"""Distributed restore: every rank loads the same step, each reading only its own bytes.

1. Rank 0's list of committed steps (newest first, or just the requested step) is shared through
   the Store; every rank tries the same candidate.
2. Each rank loads it into its own state: targets that are DTensor shards read only the byte
   spans of the saved shards that overlap them (:mod:`flashckpt.engine.restore.reader`), so a
   checkpoint saved on N ranks loads on M.
3. Barrier ``load-<step>``: if every rank succeeded, done. If the failures are all damaged
   checkpoints and no step was requested, every rank moves on to the next older step together.
   Otherwise every rank raises the same ``DistributedError`` (phase ``restore``) naming the
   failing ranks and their errors (a failing rank's own exception is its ``__cause__``).

With peer replication the memory tier is node-local: before step 1's candidates are tried from
the disk and remote tiers, the ranks try to restore from the memory tiers of the nodes
(:mod:`flashckpt.distributed.replication.peerrestore`); the disk path then tries only the steps
every rank can see.

Per-rank state on a world-size change: rank ``r`` gets ``rank_trees[str(r)]`` when the saving job
had that rank, else rank 0's per-rank state, with a warning (the RNG and data position of ranks
that no longer exist cannot be resumed exactly; ``ResumableSampler`` re-stripes the remaining
samples of the epoch).
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch

from flashckpt.distributed.group.barrier import StoreBarrier
from flashckpt.distributed.group.context import DistContext
from flashckpt.distributed.replication.peerrestore import PeerSource, restore_from_peers
from flashckpt.errors import CorruptCheckpointError, DistributedError, FlashCkptError, StorageError
from flashckpt.state.dtensor import is_dtensor
from flashckpt.store.store import CheckpointStore

log = logging.getLogger(__name__)


def restore_agreed(
    dist: DistContext,
    store: CheckpointStore,
    *,
    step: int | None,
    steps: list[int],
    load: Callable[[int], Any],
    on_corrupt: Callable[[int, str], None],
    state: Mapping[str, Any] | None = None,
    peer: PeerSource | None = None,
) -> int | None:
    """Load the same step on every rank (see the module docstring); returns it, or None.

    Optimizers in ``state`` are given their sharded state just before the first load, and put
    back exactly as they were when nothing gets loaded (:class:`OptimizerInit`). ``peer``: this
    rank's node-local memory tier under peer replication (``load`` then reads only the slower
    tiers)."""
    barrier = dist.barrier("restore", "any" if step is None else step)
    init = OptimizerInit(state or {})
    loaded = None
    try:
        mine = [step] if step is not None else sorted(steps, reverse=True)
        values = barrier.exchange("candidates", {"ok": True, "steps": mine, "peer": bool(peer)})
        node_local = all(v.get("peer") for v in values)
        if peer is not None and node_local:
            loaded = restore_from_peers(
                barrier, dist.rank, peer, step, values, init.apply, state or {}
            )
            if loaded is not None and peer.restored is not None:
                peer.restored(loaded)  # it may be in the node tiers only: on to the disk tier
        if loaded is None:
            cands = _common(values) if node_local else list(values[0]["steps"])
            loaded = _agree_and_load(barrier, dist, store, step, cands, load, on_corrupt, init)
        return loaded
    finally:
        if loaded is None:
            init.undo()
        dist.finished(barrier)


def _agree_and_load(
    barrier: StoreBarrier,
    dist: DistContext,
    store: CheckpointStore,
    step: int | None,
    candidates: list[int],
    load: Callable[[int], Any],
    on_corrupt: Callable[[int, str], None],
    init: OptimizerInit,
) -> int | None:
    for cand in candidates:
        local: BaseException | None = None
        try:
            init.apply()
            _warn_world_size(dist, store, cand)
            load(cand)
        except Exception as exc:
            local = exc
        status = {
            "ok": local is None,
            "error": f"{type(local).__name__}: {local}" if local else "",
            "corrupt": isinstance(local, (CorruptCheckpointError, StorageError)),
        }
        values = barrier.exchange(f"load-{cand}", status)
        failed = [r for r, v in enumerate(values) if not v.get("ok")]
        if not failed:
            return int(cand)
        if step is None and all(values[r].get("corrupt") for r in failed):
            msg = "; ".join(f"rank {r}: {values[r].get('error')}" for r in failed)
            on_corrupt(cand, msg)
            continue
        detail = "; ".join(f"rank {r}: {values[r].get('error')}" for r in failed)
        err = DistributedError(
            f"restore of step {cand} failed on rank(s) {failed}: {detail}",
            phase="restore",
            ranks=failed,
        )
        raise err from local
    return None


def _common(values: list[dict[str, Any]]) -> list[int]:
    """Rank 0's candidates that every rank can see (node-local memory tiers differ by node)."""
    seen = [{int(s) for s in v["steps"]} for v in values]
    return [int(s) for s in values[0]["steps"] if all(int(s) in mine for mine in seen)]


def _warn_world_size(dist: DistContext, store: CheckpointStore, step: int) -> None:
    try:
        manifest = store.load_manifest(step)
    except FlashCkptError:  # only in another tier, or damaged: the load itself will tell
        return
    if manifest.world_size == dist.world_size:
        return
    per_rank = bool(manifest.rank_trees.get("0")) or manifest.world_size == 1
    if dist.rank >= manifest.world_size and per_rank:
        warnings.warn(
            f"checkpoint step {step} was saved by {manifest.world_size} rank(s), this job has "
            f"{dist.world_size}: rank {dist.rank} resumes from rank 0's per-rank state (RNG, data "
            "position); ResumableSampler re-stripes, other per-rank state is not exact",
            stacklevel=3,
        )
    else:
        log.info(
            "restoring step %d saved by %d ranks on %d ranks (resharding)",
            step,
            manifest.world_size,
            dist.world_size,
        )


class OptimizerInit:
    """Gives empty optimizers over DTensor parameters their state (zeros), so a restore fills
    sharded tensors in place instead of handing them full tensors (as DCP does), and takes it
    back when nothing is loaded.

    :meth:`apply` runs one ``step()`` with zero gradients and the learning rate set to 0, so
    parameters do not change; the restored state then overwrites the optimizer state.
    :meth:`undo` empties the state again (it was empty before) and restores what ``step()``
    changed on the optimizer object, so a restore that loads nothing leaves every optimizer
    exactly as it was (Adam's first real update then is the same as without the restore).
    """

    def __init__(self, state: Mapping[str, Any]) -> None:
        self.todo = [opt for opt in state.values() if _needs_state(opt)]
        self.done: list[tuple[torch.optim.Optimizer, dict[str, Any], list[dict[str, Any]]]] = []

    def apply(self) -> None:
        for opt in self.todo:
            self.done.append((opt, dict(opt.__dict__), [dict(g) for g in opt.param_groups]))
            _zero_step(opt)
        self.todo = []

    def undo(self) -> None:
        for opt, attrs, groups in self.done:
            opt.state.clear()
            for g, saved in zip(opt.param_groups, groups):
                g.clear()
                g.update(saved)
            for k in [k for k in opt.__dict__ if k not in attrs]:
                delattr(opt, k)
            for k, v in attrs.items():
                if k != "state":
                    setattr(opt, k, v)
        self.done = []


def _needs_state(value: Any) -> bool:
    if not isinstance(value, torch.optim.Optimizer) or value.state:
        return False
    params = [p for g in value.param_groups for p in g["params"]]
    return any(is_dtensor(p) for p in params) and all(p.grad is None for p in params)


def _zero_step(opt: torch.optim.Optimizer) -> None:
    params = [p for g in opt.param_groups for p in g["params"]]
    for p in params:
        if p.requires_grad:
            p.grad = torch.zeros_like(p)
    lrs = [g.get("lr") for g in opt.param_groups]
    for g in opt.param_groups:
        if "lr" in g:
            g["lr"] = torch.tensor(0.0) if isinstance(g["lr"], torch.Tensor) else 0.0
    try:
        opt.step()
    finally:
        for g, lr in zip(opt.param_groups, lrs):
            if lr is not None:
                g["lr"] = lr
        opt.zero_grad(set_to_none=True)
