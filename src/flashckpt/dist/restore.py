"""Distributed restore: every rank loads the same step, each reading only its own bytes.

1. Rank 0's list of committed steps (newest first, or just the requested step) is shared through
   the Store; every rank tries the same candidate.
2. Each rank loads it into its own state: targets that are DTensor shards read only the byte
   spans of the saved shards that overlap them (:mod:`flashckpt.engine.reader`), so a checkpoint
   saved on N ranks loads on M.
3. Barrier ``load-<step>``: if every rank succeeded, done. If the failures are all damaged
   checkpoints and no step was requested, every rank moves on to the next older step together.
   Otherwise a failing rank raises its own error and the others a ``DistributedError`` naming
   the failing ranks.

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

from flashckpt.dist.context import DistContext
from flashckpt.errors import (
    CorruptCheckpointError,
    DistributedError,
    FlashCkptError,
    StorageError,
)
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
) -> int | None:
    """Load the same step on every rank (see the module docstring); returns it, or None."""
    barrier = dist.barrier("restore")
    mine = [step] if step is not None else sorted(steps, reverse=True)
    candidates = barrier.exchange("candidates", {"steps": mine})[0]["steps"]
    for cand in candidates:
        local: FlashCkptError | None = None
        try:
            _warn_world_size(dist, store, cand)
            load(cand)
        except FlashCkptError as exc:
            local = exc
        status = {
            "ok": local is None,
            "error": f"{type(local).__name__}: {local}" if local else "",
            "corrupt": isinstance(local, (CorruptCheckpointError, StorageError)),
        }
        values = barrier.exchange(f"load-{cand}", status)
        failed = [r for r, v in enumerate(values) if not v.get("ok")]
        if not failed:
            return cand
        if step is None and all(values[r].get("corrupt") for r in failed):
            msg = "; ".join(f"rank {r}: {values[r].get('error')}" for r in failed)
            on_corrupt(cand, msg)
            continue
        if local is not None:
            raise local
        detail = "; ".join(f"rank {r}: {values[r].get('error')}" for r in failed)
        raise DistributedError(
            f"restore of step {cand} failed on rank(s) {failed}: {detail}",
            phase="restore",
            ranks=failed,
        )
    return None


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


def init_sharded_optimizers(state: Mapping[str, Any]) -> None:
    """Give empty optimizers over DTensor parameters their state (zeros), so a restore fills
    sharded tensors in place instead of handing them full tensors (as DCP does).

    Runs one ``step()`` with zero gradients and the learning rate set to 0, so parameters do
    not change; the restored state then overwrites the optimizer state.
    """
    for value in state.values():
        if not isinstance(value, torch.optim.Optimizer) or value.state:
            continue
        params = [p for g in value.param_groups for p in g["params"]]
        if not any(is_dtensor(p) for p in params) or any(p.grad is not None for p in params):
            continue
        for p in params:
            if p.requires_grad:
                p.grad = torch.zeros_like(p)
        lrs = [g.get("lr") for g in value.param_groups]
        for g in value.param_groups:
            if "lr" in g:
                g["lr"] = torch.tensor(0.0) if isinstance(g["lr"], torch.Tensor) else 0.0
        value.step()
        for g, lr in zip(value.param_groups, lrs):
            if lr is not None:
                g["lr"] = lr
        value.zero_grad(set_to_none=True)
