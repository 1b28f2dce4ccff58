"""Merge the ranks' part manifests into the one manifest rank 0 publishes.

Tensors are united; a key saved by several ranks (shards of a DTensor) gets all their shards,
each tagged with its rank. Chunks are deduplicated by hash and extent indices remapped. The
merged tree is rank 0's, ``rank_trees`` holds every rank's per-rank entries, ``world_size`` the
number of parts. Before anything is published every tensor is checked to be covered exactly
once (the shards' volumes add up to the global shape), so ranks that disagree about which
tensors are replicated, or a missing shard, make the save fail instead of leaving a hole.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from flashckpt.errors import DistributedError
from flashckpt.store.manifest import ChunkRef, Manifest, Shard, TensorEntry


def merge_parts(parts: Sequence[Manifest], *, step: int) -> Manifest:
    """One manifest from the parts of ranks ``0..len(parts)-1`` (``parts[r]`` is rank r's)."""
    chunks: list[ChunkRef] = []
    index: dict[str, int] = {}
    tensors: dict[str, TensorEntry] = {}
    for rank, part in enumerate(parts):
        if part.step != step:
            raise DistributedError(
                f"part of rank {rank} is for step {part.step}, expected {step}",
                phase="publish",
                ranks=[rank],
            )
        remap = []
        for ref in part.chunks:
            if ref.hash not in index:
                index[ref.hash] = len(chunks)
                chunks.append(ref)
            remap.append(index[ref.hash])
        for key, entry in part.tensors.items():
            shards = tuple(_remap(s, remap, rank) for s in entry.shards)
            tensors[key] = _add(tensors.get(key), entry, shards, rank)
    for entry in tensors.values():
        _check_coverage(entry)
    return Manifest(
        step=step,
        time_s=max(p.time_s for p in parts),
        world_size=len(parts),
        tree=parts[0].tree,
        rank_trees={str(r): p.rank_trees.get(str(r), {}) for r, p in enumerate(parts)},
        tensors=tensors,
        chunks=chunks,
        stats=_sum_stats([p.stats for p in parts]),
        library=parts[0].library,
    )


def _remap(shard: Shard, remap: list[int], rank: int) -> Shard:
    extents = tuple(replace(x, chunk=remap[x.chunk]) for x in shard.extents)
    return replace(shard, extents=extents, rank=rank)


def _add(
    prev: TensorEntry | None, entry: TensorEntry, shards: tuple[Shard, ...], rank: int
) -> TensorEntry:
    if prev is None:
        return replace(entry, shards=shards)
    if (prev.kind, prev.dtype, prev.global_shape) != (entry.kind, entry.dtype, entry.global_shape):
        raise DistributedError(
            f"tensor {entry.key!r}: rank {rank} saved {entry.dtype}{list(entry.global_shape)}, "
            f"an earlier rank {prev.dtype}{list(prev.global_shape)}; every rank must hold the "
            "same model",
            phase="publish",
            ranks=[rank],
        )
    seen = {(s.offset, s.shape) for s in prev.shards}
    new = tuple(s for s in shards if (s.offset, s.shape) not in seen)  # replicas of a box
    return replace(prev, shards=prev.shards + new)


def _check_coverage(entry: TensorEntry) -> None:
    covered = sum(s.numel for s in entry.shards)
    total = math.prod(entry.global_shape)
    if covered != total:
        raise DistributedError(
            f"tensor {entry.key!r} has {covered} of {total} elements saved across ranks "
            f"{sorted({s.rank for s in entry.shards})}: ranks disagree on the state (different "
            "models or optimizer states per rank?); nothing was published",
            phase="publish",
            ranks=[0],
        )


def _sum_stats(stats: Sequence[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for s in stats:
        for k, v in s.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                out[k] = out.get(k, 0) + v
    if "staged_s" in out or "background_s" in out:  # durations: the slowest rank, not the sum
        for k in ("staged_s", "background_s", "blocking_s"):
            vals = [s[k] for s in stats if isinstance(s.get(k), (int, float))]
            if vals:
                out[k] = max(vals)
    return out
