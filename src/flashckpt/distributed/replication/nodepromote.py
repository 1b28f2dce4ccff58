"""Promotion of a step from the node-local memory tiers to the shared disk tier (replicas=1).

No single rank can read a node-local step whole (its tier holds its node's chunks and its
replicas only), so the copy is distributed, inside a replication round (side group, every rank):

1. rank 0 decides whether the disk tier wants the step (its retention would keep it and it does
   not hold it yet: ``TierSet.wants``); all-reduce, so every rank takes rank 0's answer;
2. every rank opens a liveness window on the disk tier (no garbage collection while it copies;
   what it reuses is pinned) and copies the chunks it wrote that the tier lacks, each read back
   from its node tier and verified first, then syncs their directories;
3. all-reduce of failures: when none, rank 0 commits the manifest in the disk tier (the chunks of
   every rank are durable there by then);
4. all-reduce of rank 0's outcome: every rank closes its window (committed, or failed: what it
   wrote becomes a gc candidate). Rank 0 journals ``promoted`` (or ``promote_failed``) and hands
   the step on (``after``: the replicator queues its promotion to the remote tier, from the disk
   tier by the ordinary promoter, and the disk tier's retention, off the replication thread).

A failure here is journaled and the step stays in the memory tiers; it never breaks the round.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from flashckpt.distributed.replication.transfer import Exchange, rank_chunks
from flashckpt.errors import FlashCkptError
from flashckpt.journal import Journal
from flashckpt.store.format.manifest import Manifest

log = logging.getLogger(__name__)


def promote_round(
    ex: Exchange,
    *,
    rank: int,
    manifest: Manifest,
    src: Any,
    dst: Any,
    tiers: Any,
    journal: Journal,
    after: Callable[[Manifest], object],
) -> bool:
    """Steps 1-4 of the module docstring; True when the step was committed in ``dst``. Rank 0
    then calls ``after(manifest)``, which must not block (it queues the remote promotion and the
    disk tier's retention elsewhere: a promoter queue that is full must not hold up the round)."""
    step = manifest.step
    want = 0
    if rank == 0 and dst is not None:
        try:
            want = int(tiers.wants(dst, step))
        except FlashCkptError as exc:
            log.warning("cannot tell whether the %s tier wants step %d: %s", dst.name, step, exc)
    if not ex.all_reduce([want], "max")[0]:
        return False
    t0 = time.perf_counter()
    win = dst.store.liveness.open_window(kind="promote", step=step)
    error, nbytes = _copy_own(win, rank, manifest, src, dst)
    failures, total = ex.all_reduce([0 if error is None else 1, nbytes])
    committed = 0
    if rank == 0 and failures == 0:
        try:
            dst.store.commit(manifest, chunk_dirs=[])
            committed = 1
        except (OSError, FlashCkptError) as exc:
            error = f"rank 0 committing the manifest: {exc}"
    ok = ex.all_reduce([committed], "max")[0] == 1
    if ok:
        win.committed()
    else:
        win.failed()
    if rank == 0:
        _journal(ok, step, dst, journal, time.perf_counter() - t0, total, error)
        if ok:
            after(manifest)
    elif error is not None:
        log.warning("promoting step %d to the %s tier: %s", step, dst.name, error)
    return ok


def _copy_own(
    win: Any, rank: int, manifest: Manifest, src: Any, dst: Any
) -> tuple[str | None, int]:
    written: list[str] = []
    nbytes = 0
    try:
        for ref in rank_chunks(manifest, rank):
            if win.claim(ref.hash, ref.size) is not None:
                continue  # the disk tier holds it (an unchanged chunk, or another rank's)
            raw = src.store.read_chunk(ref, step=manifest.step)  # verified against its hash
            dst.store.put_chunk(ref.hash, ref.size, [raw], ref.codec)
            written.append(ref.hash)
            nbytes += ref.size
        dst.store.backend.sync_dirs(dst.store.chunk_dirs(written))
    except (OSError, FlashCkptError) as exc:
        return f"rank {rank}: {type(exc).__name__}: {exc}", nbytes
    return None, nbytes


def _journal(
    ok: bool,
    step: int,
    dst: Any,
    journal: Journal,
    seconds: float,
    nbytes: int,
    error: str | None,
) -> None:
    if not ok:
        journal.append(
            "promote_failed", step=step, src="memory", dst=dst.name, error=error or "a rank failed"
        )
        return
    journal.append("promoted", step=step, src="memory", dst=dst.name, seconds=seconds, bytes=nbytes)
