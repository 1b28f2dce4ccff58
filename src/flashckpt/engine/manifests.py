"""The manifest one save job commits: its chunks, in first-use order, and each tensor's shard
as extents of those chunks (the layout is engine/layout.py's)."""

from __future__ import annotations

import time
from typing import Any

from flashckpt.engine.context import SaveContext
from flashckpt.engine.layout import ChunkPlan
from flashckpt.state.capture import Captured
from flashckpt.store.manifest import ChunkRef, Extent, Manifest, Shard, TensorEntry


def job_manifest(
    *,
    step: int,
    hashes: list[str],
    refs: dict[str, ChunkRef],
    chunks: list[ChunkPlan],
    captured: Captured,
    ctx: SaveContext,
    stats: dict[str, Any],
) -> Manifest:
    """This rank's manifest of a save, once every chunk in ``hashes`` is durable."""
    order: dict[str, int] = {}
    stored: list[ChunkRef] = []
    for h in hashes:
        if h not in order:
            order[h] = len(stored)
            stored.append(refs[h])
    extents: dict[int, list[Extent]] = {}
    for ci, chunk in enumerate(chunks):
        off = 0
        for piece in chunk.pieces:
            ext = Extent(chunk=order[hashes[ci]], offset=off, length=piece.length)
            extents.setdefault(piece.item, []).append(ext)
            off += piece.length
    tensors = {}
    for idx, item in enumerate(captured.items):
        shard = Shard(
            offset=item.global_offset,
            shape=item.shape,
            extents=tuple(extents.get(idx, ())),
            rank=ctx.rank,
        )
        tensors[item.key] = TensorEntry(
            key=item.key,
            kind=item.kind,
            dtype=item.dtype,
            global_shape=item.global_shape,
            shards=(shard,),
        )
    return Manifest(
        step=step,
        time_s=time.time(),
        world_size=ctx.world_size,
        tree=captured.tree,
        tensors=tensors,
        chunks=stored,
        stats=stats,
        library=ctx.library,
    )
