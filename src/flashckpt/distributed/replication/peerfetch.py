"""Fetch the chunks a node's memory tier lacks from the memory tiers of other nodes (gloo).

A collective over a gloo group: every rank of the group calls :func:`fetch_chunks` with the
chunks its tier needs (for one step) and the identity of its tier (:func:`tier_identity`:
ranks that report the same identity share one tier, whatever node they believe they are on).

1. **Needs**: each rank checks which of its chunks are really present in its tier (a file of the
   size at rest the manifest records) and all ranks exchange the missing ones with their tier
   identity (JSON over ``all_gather``; nothing is pickled). The chunks a tier lacks are the union
   of its ranks' needs, fetched once per tier, spread over that tier's ranks (least bytes first).
2. **Holders**: each rank reports which of the chunks missing anywhere its own tier holds; a
   chunk is assigned to the holder with the least bytes assigned so far (every rank computes the
   same plan from the same exchanged data).
3. **Transfers**: every rank walks its own sends and receives in the plan's order, with at most
   ``max_inflight_bytes`` posted (at least one transfer), waiting on the oldest first: the
   transfer lowest in the plan that is not done is then posted at both ends, so the walk never
   deadlocks. A transfer is a header (int64: the bytes the holder read, -1 when it could not
   read its copy) and a payload of the planned size (the chunk's bytes at rest), with tags
   unique to the transfer; both are posted at once at both ends, so transfers pipeline.
4. **Trust nothing**: the receiver decodes and hashes what it got before writing it into its tier
   through the store's backend (and tells the tier's liveness). Bytes that do not match the hash
   are damage: journaled (``corrupt``, ``tier="peer"``), and that holder is not used again. The
   outcomes are exchanged and what is still missing is assigned again to the remaining holders.
   A chunk that no (usable) holder has raises :class:`PeerFetchError` naming it and the step, on
   every rank alike.

A rank that dies mid-transfer makes the gloo operations of its partners fail (after the group's
timeout): that error propagates and the caller decides, with every rank, what to do next
(:mod:`flashckpt.distributed.restore` falls back to the disk and remote tiers).
"""

from __future__ import annotations

import json
import os
import time
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from flashckpt.distributed.replication.peerplan import (
    FetchPlan,
    PeerFetchError,
    Transfer,
    stored_size,
)
from flashckpt.errors import CorruptCheckpointError, StorageError
from flashckpt.journal import Journal
from flashckpt.store.format import codec as codecs
from flashckpt.store.format.manifest import ChunkRef
from flashckpt.store.pins import BOOT, HOST, Window
from flashckpt.store.store import CheckpointStore, chunk_path

MAX_INFLIGHT_BYTES = 256 << 20
_TAG_BASE = 1 << 20

__all__ = ["FetchPlan", "FetchStats", "PeerFetchError", "fetch_chunks", "plan_fetch", "run_fetch"]


@dataclass(kw_only=True)
class FetchStats:
    """What one rank moved in one :func:`fetch_chunks`."""

    rank: int
    received_bytes: int = 0
    received_chunks: int = 0
    sent_bytes: int = 0
    sent_chunks: int = 0
    seconds: float = 0.0
    sources: dict[int, int] = field(default_factory=dict)  # holder rank -> bytes received
    damaged: list[dict[str, Any]] = field(default_factory=list)  # {"chunk", "holder", "error"}
    rounds: int = 0


def tier_identity(path: str | os.PathLike[str]) -> str:
    """Who a tier directory is: this host and boot, and the directory's device and inode. Ranks
    on one machine that use different directories (simulated nodes) get different identities;
    ranks of one node that share a directory get the same one."""
    st = os.stat(Path(path))
    return f"{HOST}/{BOOT}/{st.st_dev}/{st.st_ino}"


def present(store: CheckpointStore, ref: ChunkRef) -> bool:
    """Is ``ref`` really in ``store``: a file of the size at rest the manifest records."""
    try:
        return store.backend.size(chunk_path(ref.hash, ref.codec)) == stored_size(ref)
    except (OSError, StorageError):
        return False


def fetch_chunks(
    group: Any,
    store: CheckpointStore,
    refs: Iterable[ChunkRef],
    *,
    step: int,
    tier: str,
    journal: Journal | None = None,
    window: Window | None = None,
    max_inflight_bytes: int = MAX_INFLIGHT_BYTES,
) -> FetchStats:
    """Make every chunk of ``refs`` present in ``store`` (see the module docstring); a
    collective: every rank of ``group`` calls it. ``window``: the caller's liveness window on
    ``store``, which pins what is fetched until the caller's manifest names it."""
    plan = plan_fetch(group, store, refs, tier=tier, window=window)
    return run_fetch(
        group, store, plan, step=step, journal=journal, max_inflight_bytes=max_inflight_bytes
    )


def plan_fetch(
    group: Any,
    store: CheckpointStore,
    refs: Iterable[ChunkRef],
    *,
    tier: str,
    error: str = "",
    window: Window | None = None,
) -> FetchPlan:
    """Steps 1-2 of the module docstring (two ``all_gather``): who lacks what, who holds it.
    ``error``: this rank cannot take part (it names no needs); every rank sees it in
    :attr:`FetchPlan.errors`."""
    t0 = time.perf_counter()
    needed = {r.hash: r for r in refs}
    if window is not None:
        for ref in needed.values():
            window.claim(ref.hash, ref.size)
    mine = [r.to_json() for r in needed.values() if not present(store, r)]
    plan = FetchPlan.build(allgather_json(group, {"tier": tier, "need": mine, "error": error}))
    holds = [h for h, ref in sorted(plan.wanted.items()) if present(store, ref)]
    plan.holders(allgather_json(group, holds))
    plan.seconds = time.perf_counter() - t0
    return plan


def run_fetch(
    group: Any,
    store: CheckpointStore,
    plan: FetchPlan,
    *,
    step: int,
    journal: Journal | None = None,
    max_inflight_bytes: int = MAX_INFLIGHT_BYTES,
) -> FetchStats:
    """Steps 3-4 of the module docstring: move and verify what ``plan`` says, round by round."""
    t0 = time.perf_counter() - plan.seconds
    rank = dist.get_rank(group)
    stats = FetchStats(rank=rank)
    if plan.errors:
        what = "; ".join(f"rank {r}: {e}" for r, e in sorted(plan.errors.items()))
        raise PeerFetchError(
            f"step {step}: not every rank can fetch from peers ({what})", step=step
        )
    while plan.missing_anywhere():
        stats.rounds += 1
        transfers = plan.assign(step)
        outcome = _run(group, rank, store, transfers, stats, step, journal, max_inflight_bytes)
        for h in plan.update(allgather_json(group, outcome), step).get(rank, []):
            store.liveness.quarantine(
                plan.wanted[h], reason=f"a peer found it damaged (step {step})"
            )
    stats.seconds = time.perf_counter() - t0
    return stats


@dataclass(kw_only=True)
class _Op:
    t: Transfer
    sending: bool
    header: torch.Tensor
    payload: torch.Tensor
    works: list[Any] = field(default_factory=list)


def _run(
    group: Any,
    rank: int,
    store: CheckpointStore,
    transfers: Sequence[Transfer],
    stats: FetchStats,
    step: int,
    journal: Journal | None,
    limit: int,
) -> dict[str, Any]:
    """Walk this rank's part of the round (module docstring, step 3); its outcome."""
    outcome: dict[str, Any] = {"rank": rank, "done": [], "bad": [], "declined": [], "error": ""}
    todo = deque(t for t in transfers if rank in (t.src, t.dst))
    posted: deque[_Op] = deque()
    inflight = 0
    while todo or posted:
        while todo and (not posted or inflight + todo[0].nbytes <= limit):
            t = todo.popleft()
            posted.append(_post_send(group, store, t) if t.src == rank else _post_recv(group, t))
            inflight += t.nbytes
        op = posted.popleft()
        inflight -= op.t.nbytes
        if op.sending:
            for w in op.works:
                w.wait()
            stats.sent_bytes += op.t.nbytes if int(op.header[0]) >= 0 else 0
            stats.sent_chunks += 1 if int(op.header[0]) >= 0 else 0
        else:
            _finish_recv(store, op, stats, step, journal, outcome)
    return outcome


def _post_send(group: Any, store: CheckpointStore, t: Transfer) -> _Op:
    """The header says how many bytes the holder read (-1: it could not read its copy); the
    payload always has the planned size, so the receiver posts both at once (pipelined)."""
    payload = torch.empty(t.nbytes, dtype=torch.uint8)
    try:
        n = store.backend.read_into(chunk_path(t.ref.hash, t.ref.codec), _view(payload))
    except (OSError, StorageError):
        n = -1
    header = torch.tensor([n if n == t.nbytes else -1], dtype=torch.int64)
    return _post(dist.isend, group, t, t.dst, header, payload, sending=True)


def _post_recv(group: Any, t: Transfer) -> _Op:
    header = torch.zeros(1, dtype=torch.int64)
    payload = torch.empty(t.nbytes, dtype=torch.uint8)
    return _post(dist.irecv, group, t, t.src, header, payload, sending=False)


def _post(
    fn: Any,
    group: Any,
    t: Transfer,
    peer: int,
    header: torch.Tensor,
    payload: torch.Tensor,
    *,
    sending: bool,
) -> _Op:
    where = {"group_dst": peer} if sending else {"group_src": peer}
    op = _Op(t=t, sending=sending, header=header, payload=payload)
    op.works.append(fn(header, group=group, tag=_tag(t, 0), **where))
    if t.nbytes:
        op.works.append(fn(payload, group=group, tag=_tag(t, 1), **where))
    return op


def _view(t: torch.Tensor) -> memoryview:
    return memoryview(t.numpy())  # type: ignore[arg-type]


def _finish_recv(
    store: CheckpointStore,
    op: _Op,
    stats: FetchStats,
    step: int,
    journal: Journal | None,
    outcome: dict[str, Any],
) -> None:
    t = op.t
    for w in op.works:
        w.wait()
    if int(op.header[0]) < 0:
        outcome["declined"].append([t.ref.hash, t.src])
        return
    data = _view(op.payload)
    try:
        _verify(t.ref, data, step)
    except CorruptCheckpointError as exc:
        _damaged(t, str(exc), stats, step, journal, outcome)
        return
    try:
        written = store.backend.put(chunk_path(t.ref.hash, t.ref.codec), [data])
    except (OSError, StorageError) as exc:
        outcome["error"] = outcome["error"] or f"cannot write chunk {t.ref.hash}: {exc}"
        return
    ref = ChunkRef(hash=t.ref.hash, size=t.ref.size, codec=t.ref.codec, stored_size=written)
    store.liveness.added(ref)
    stats.received_bytes += t.nbytes
    stats.received_chunks += 1
    stats.sources[t.src] = stats.sources.get(t.src, 0) + t.nbytes
    outcome["done"].append(t.ref.hash)


def _verify(ref: ChunkRef, data: memoryview, step: int) -> None:
    if len(data) != stored_size(ref):
        raise CorruptCheckpointError(
            f"chunk {ref.hash} of step {step} arrived with {len(data)} bytes, expected "
            f"{stored_size(ref)}",
            step=step,
            chunk=ref.hash,
        )
    raw = (
        data
        if ref.codec == "raw"
        else codecs.decode(bytes(data), ref.codec, ref.size, chunk=ref.hash)
    )
    if len(raw) != ref.size or codecs.hash_parts([raw]) != ref.hash:
        raise CorruptCheckpointError(
            f"chunk {ref.hash} of step {step} arrived damaged: its content does not match its hash",
            step=step,
            chunk=ref.hash,
        )


def _damaged(
    t: Transfer,
    error: str,
    stats: FetchStats,
    step: int,
    journal: Journal | None,
    outcome: dict[str, Any],
) -> None:
    stats.damaged.append({"chunk": t.ref.hash, "holder": t.src, "error": error})
    outcome["bad"].append([t.ref.hash, t.src])
    if journal is not None:
        journal.append(
            "corrupt", step=step, tier="peer", chunk=t.ref.hash, holder=t.src, error=error
        )


def _tag(t: Transfer, part: int) -> int:
    return _TAG_BASE + 2 * t.index + part


def allgather_json(group: Any, obj: Any) -> list[Any]:
    """``obj`` of every rank of ``group``, in rank order, as JSON over two ``all_gather``."""
    data = json.dumps(obj, separators=(",", ":")).encode()
    world = dist.get_world_size(group)
    size = torch.tensor([len(data)], dtype=torch.int64)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(sizes, size, group=group)
    top = max(int(s[0]) for s in sizes)
    buf = torch.zeros(top, dtype=torch.uint8)
    if data:
        buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    bufs = [torch.zeros(top, dtype=torch.uint8) for _ in range(world)]
    dist.all_gather(bufs, buf, group=group)
    return [json.loads(b[: int(s[0])].numpy().tobytes()) for b, s in zip(bufs, sizes)]


def broadcast_bytes(group: Any, data: bytes, src: int) -> bytes:
    """``data`` of group rank ``src`` on every rank of ``group`` (size first, then bytes)."""
    size = torch.tensor([len(data)], dtype=torch.int64)
    dist.broadcast(size, group=group, group_src=src)
    buf = torch.zeros(int(size[0]), dtype=torch.uint8)
    if dist.get_rank(group) == src and data:
        buf[:] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    if int(size[0]):
        dist.broadcast(buf, group=group, group_src=src)
    return buf.numpy().tobytes()
