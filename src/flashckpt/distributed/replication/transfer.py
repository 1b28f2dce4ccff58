"""The ring exchange of one replication round, over the gloo side group (no size headers needed).

Both ends of a pair know the round's global manifest (every node's tier holds it), so both
compute the same sorted list of the sender's chunks (:func:`rank_chunks`) and their raw sizes.
Script of :meth:`Exchange.run` on every rank (each is a sender to ``peer`` and a receiver from
each of its ``sources``):

1. **masks**: post a receive of one byte per own chunk from ``peer`` (1: it lacks that chunk)
   and send a mask to each source (computed by the caller: which of its chunks this node
   lacks); wait for all. Unchanged chunks are never sent again: the peer's tier already holds
   them.
2. **chunks**, in batches of at most half of ``inflight_bytes`` (at least one chunk) that both
   ends cut the same way from the mask and the sizes: in iteration k every rank posts the
   receive of batch k from each source and the send of its batch k to its peer, then handles
   batch k-1 (step 3) while batch k travels, then waits for batch k. Every transfer of
   iteration k is posted by both ends before either waits, so the ring cannot deadlock,
   whatever the number of batches per pair; at most two batches per direction are in memory.
3. Each received chunk is handed to ``write(source, ref, bytes)``, which verifies its hash.

The sender reads its chunks straight into the send buffer without hashing them again: the
receiver's check is the one that counts. A chunk the sender cannot read is sent as zeros of the
right size (the exchange stays in lockstep; the receiver's hash check fails it). Any gloo error
or timeout raises :class:`ReplicationBroken`: the side group is unusable from then on.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

from flashckpt.errors import DistributedError
from flashckpt.store.format.manifest import ChunkRef, Manifest

log = logging.getLogger(__name__)

Read = Callable[[ChunkRef, memoryview], None]  # fill the view with one own chunk's raw bytes
Write = Callable[[int, ChunkRef, memoryview], None]


class ReplicationBroken(DistributedError):
    """The side group failed (a peer died, hung or is unreachable); gloo groups do not recover."""


def rank_chunks(manifest: Manifest, rank: int) -> list[ChunkRef]:
    """The chunks ``rank`` wrote for ``manifest`` (its shards' extents), sorted by hash."""
    refs: dict[str, ChunkRef] = {}
    for entry in manifest.tensors.values():
        for shard in entry.shards:
            if shard.rank == rank:
                for x in shard.extents:
                    ref = manifest.chunks[x.chunk]
                    refs.setdefault(ref.hash, ref)
    return [refs[h] for h in sorted(refs)]


def batches(refs: Sequence[ChunkRef], limit: int) -> list[list[ChunkRef]]:
    """``refs`` cut into runs of at most ``limit`` raw bytes (a larger chunk goes alone)."""
    out: list[list[ChunkRef]] = []
    size = 0
    for ref in refs:
        if not out or (size + ref.size > limit and out[-1]):
            out.append([])
            size = 0
        out[-1].append(ref)
        size += ref.size
    return out


class Exchange:
    """Point-to-point transfers of one rank on the side group (module docstring)."""

    def __init__(
        self,
        *,
        group: Any,
        peer: int,
        sources: Sequence[int],
        timeout_s: float,
        inflight_bytes: int,
    ) -> None:
        self.group = group
        self.peer = peer
        self.sources = list(sources)
        self.timeout = timedelta(seconds=timeout_s)
        self.inflight_bytes = inflight_bytes

    # -- collectives --------------------------------------------------------------------------
    def all_reduce(self, values: list[int], op: str = "sum") -> list[int]:
        import torch
        import torch.distributed as dist

        t = torch.tensor(values, dtype=torch.int64)
        ops = {"sum": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX}
        self._wait([dist.all_reduce(t, op=ops[op], group=self.group, async_op=True)], "agreeing")
        return [int(v) for v in t.tolist()]

    def _wait(self, works: Sequence[Any], doing: str) -> None:
        try:
            for w in works:
                if w is not None:
                    w.wait(self.timeout)
        except Exception as exc:
            raise self._broken(doing, exc) from exc

    def _broken(self, doing: str, exc: BaseException) -> ReplicationBroken:
        return ReplicationBroken(
            f"the replication side group failed while {doing} (peer rank {self.peer}, "
            f"sources {self.sources}): {type(exc).__name__}: {exc}",
            phase="replicate",
            ranks=[self.peer, *self.sources],
        )

    # -- one round ----------------------------------------------------------------------------
    def masks(self, mine: Sequence[ChunkRef], lacks: dict[int, list[bool]]) -> list[bool]:
        """Step 1: send ``lacks[source]`` to each source; the peer's mask over ``mine``."""
        import torch
        import torch.distributed as dist

        theirs = torch.zeros(len(mine), dtype=torch.uint8)
        works = []
        try:
            if len(mine):
                works.append(dist.irecv(theirs, group=self.group, group_src=self.peer))
            for src, mask in lacks.items():
                if mask:
                    t = torch.tensor(mask, dtype=torch.uint8)
                    works.append(dist.isend(t, group=self.group, group_dst=src))
        except Exception as exc:
            raise self._broken("posting the masks", exc) from exc
        self._wait(works, "exchanging which chunks are missing")
        return [bool(v) for v in theirs.tolist()]

    def chunks(
        self,
        send: Sequence[ChunkRef],
        read: Read,
        recv: dict[int, list[ChunkRef]],
        write: Write,
    ) -> int:
        """Steps 2-3; the raw bytes sent. Batch k is written while batch k+1 travels, so each
        batch holds at most half of ``inflight_bytes``."""
        limit = max(1, self.inflight_bytes // 2)
        out = batches(send, limit)
        ins = {src: batches(refs, limit) for src, refs in recv.items()}
        rounds = max([len(out), *(len(b) for b in ins.values())], default=0)
        sent = 0
        arrived: list[tuple[int, list[ChunkRef], Any]] = []
        for k in range(rounds):
            works, bufs, nbytes = self._post(k, out, ins, read)
            sent += nbytes
            _unpack(arrived, write)  # batch k-1, while batch k is on its way
            self._wait(works, f"transferring chunk batch {k + 1} of {rounds}")
            arrived = bufs
        _unpack(arrived, write)
        return sent

    def _post(
        self, k: int, out: list[list[ChunkRef]], ins: dict[int, list[list[ChunkRef]]], read: Read
    ) -> tuple[list[Any], list[tuple[int, list[ChunkRef], Any]], int]:
        """Post the receives of batch ``k`` from every source, then its send to the peer."""
        import torch
        import torch.distributed as dist

        works, bufs, sent = [], [], 0
        try:
            for src, bs in ins.items():
                if k < len(bs):
                    buf = torch.empty(sum(r.size for r in bs[k]), dtype=torch.uint8)
                    bufs.append((src, bs[k], buf))
                    works.append(dist.irecv(buf, group=self.group, group_src=src))
            if k < len(out):
                payload = _pack(out[k], read)
                works.append(dist.isend(payload, group=self.group, group_dst=self.peer))
                sent = payload.numel()
        except Exception as exc:
            raise self._broken(f"posting chunk batch {k + 1}", exc) from exc
        return works, bufs, sent


def _unpack(arrived: list[tuple[int, list[ChunkRef], Any]], write: Write) -> None:
    for src, refs, buf in arrived:
        view = buf.numpy().data.cast("B")
        off = 0
        for ref in refs:
            write(src, ref, view[off : off + ref.size])
            off += ref.size


def _pack(refs: Sequence[ChunkRef], read: Read) -> Any:
    import torch

    buf = torch.empty(sum(r.size for r in refs), dtype=torch.uint8)
    view = buf.numpy().data.cast("B")
    off = 0
    for ref in refs:
        out = view[off : off + ref.size]
        try:
            read(ref, out)
        except Exception as exc:  # zeros instead: the peer's hash check refuses them
            log.warning("replication cannot read own chunk %s: %s", ref.hash, exc)
            out[:] = bytes(ref.size)
        off += ref.size
    return buf
