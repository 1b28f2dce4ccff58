"""Merge the ranks' part manifests into the one manifest rank 0 publishes.

Tensors are united; a key saved by several ranks (shards of a DTensor) gets all their shards,
each tagged with its rank. Chunks are deduplicated by hash and extent indices remapped. The
merged tree is rank 0's, ``rank_trees`` holds every rank's per-rank entries, ``world_size`` the
number of parts. Before anything is published every tensor is checked to be covered exactly
once (every shard inside the bounds, no two overlapping, their volumes adding up to the global
shape), so ranks that disagree about which tensors are replicated, a missing shard or an
overlapping one make the save fail instead of publishing a hole or a wrong value.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from flashckpt.errors import DistributedError
from flashckpt.store.format.manifest import ChunkRef, Manifest, Shard, TensorEntry


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
        meta=parts[0].meta,
        lineage=parts[0].lineage,  # every rank's: one generation, agreed at open
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
    """Every element of the global tensor in exactly one saved box: each box inside the bounds,
    no two boxes overlapping, and their volumes adding up to the whole."""
    gshape = entry.global_shape
    boxes = [s for s in entry.shards if s.numel > 0]
    for s in boxes:
        if len(s.offset) != len(gshape) or any(
            o < 0 or o + n > g for o, n, g in zip(s.offset, s.shape, gshape)
        ):
            _refuse(
                entry,
                f"rank {s.rank}'s shard at {list(s.offset)} of shape "
                f"{list(s.shape)} lies outside {list(gshape)}",
                [s.rank],
            )
    clash = _overlap(boxes)
    if clash is not None:
        a, b = clash
        _refuse(
            entry,
            f"the shards of ranks {a.rank} and {b.rank} overlap ({list(a.offset)}+"
            f"{list(a.shape)} and {list(b.offset)}+{list(b.shape)})",
            sorted({a.rank, b.rank}),
        )
    covered = sum(s.numel for s in boxes)
    total = math.prod(gshape)
    if covered != total:
        _refuse(
            entry,
            f"{covered} of {total} elements are saved across ranks "
            f"{sorted({s.rank for s in entry.shards})}",
            [0],
        )


def _overlap(boxes: Sequence[Shard]) -> tuple[Shard, Shard] | None:
    """Two overlapping boxes, if any: a sweep along the dimension with the most distinct
    starts, comparing a box only with the boxes still open at its start (O(n log n) for row,
    column and grid layouts)."""
    if len(boxes) < 2:
        return None
    ndim = len(boxes[0].offset)
    if ndim == 0:
        return boxes[0], boxes[1]  # two scalars
    d = max(range(ndim), key=lambda i: len({b.offset[i] for b in boxes}))
    active: list[Shard] = []
    for box in sorted(boxes, key=lambda b: b.offset[d]):
        start = box.offset[d]
        active = [a for a in active if a.offset[d] + a.shape[d] > start]
        for a in active:
            if all(
                max(o1, o2) < min(o1 + n1, o2 + n2)
                for o1, n1, o2, n2 in zip(a.offset, a.shape, box.offset, box.shape)
            ):
                return a, box
        active.append(box)
    return None


def _refuse(entry: TensorEntry, what: str, ranks: list[int]) -> None:
    raise DistributedError(
        f"tensor {entry.key!r}: {what}. The ranks disagree on the state (different models or "
        "optimizer states per rank, or placements that do not tile the tensor); nothing was "
        "published",
        phase="publish",
        ranks=ranks,
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
