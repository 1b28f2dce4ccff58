"""The manifest one save job commits: its chunks, in first-use order, and each tensor's shard
as extents of those chunks (the layout is engine/save/layout.py's)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from flashckpt.engine.save.context import SaveContext
from flashckpt.engine.save.layout import ChunkPlan
from flashckpt.state.capture import Captured
from flashckpt.store.format.manifest import (
    ChunkRef,
    Extent,
    Manifest,
    Shard,
    TensorEntry,
    tensors_json,
)


@dataclass(frozen=True, kw_only=True)
class Draft:
    """A save's tensor entries and their JSON, made while its chunks are still being written,
    on the assumption that no two chunks of the save have the same bytes (chunk ``i`` is then
    stored chunk ``i``). :func:`job_manifest` uses it only when that held."""

    tensors: dict[str, TensorEntry]
    text: str


def draft(*, chunks: list[ChunkPlan], captured: Captured, ctx: SaveContext) -> Draft:
    """The draft of this save; the last save's (``ctx.drafts``) when it was made from the same
    layout: its entries are immutable, so only the dict that holds them is new."""
    key = _layout_key(chunks, captured, ctx.rank)
    last = ctx.drafts.last
    if last is not None and last[0] == key:
        return Draft(tensors=dict(last[1].tensors), text=last[1].text)
    tensors = _tensors(list(range(len(chunks))), chunks, captured, ctx)
    made = Draft(tensors=tensors, text=tensors_json(tensors))
    ctx.drafts.last = (key, Draft(tensors=dict(tensors), text=made.text))  # (a manifest may
    return made  # change its own dict: the memo keeps another)


def _layout_key(chunks: list[ChunkPlan], captured: Captured, rank: int) -> tuple[Any, ...]:
    """Everything :func:`_tensors` reads to make a draft: each item's key, kind, dtype, shape
    and place in the global tensor, and each chunk's pieces (item, start, length)."""
    items = [
        (i.key, i.kind, i.dtype, i.shape, i.global_shape, i.global_offset) for i in captured.items
    ]
    return (rank, items, [c.pieces for c in chunks])


def job_manifest(
    *,
    step: int,
    hashes: list[str],
    refs: dict[str, ChunkRef],
    chunks: list[ChunkPlan],
    captured: Captured,
    ctx: SaveContext,
    stats: dict[str, Any],
    drafted: Draft | None = None,
) -> Manifest:
    """This rank's manifest of a save, once every chunk in ``hashes`` is durable."""
    order: dict[str, int] = {}
    stored: list[ChunkRef] = []
    for h in hashes:
        if h not in order:
            order[h] = len(stored)
            stored.append(refs[h])
    if len(stored) != len(hashes):  # chunk i is not stored chunk i: the draft does not hold
        drafted = None
    if drafted is not None:
        tensors = drafted.tensors
    else:
        tensors = _tensors([order[h] for h in hashes], chunks, captured, ctx)
    manifest = Manifest(
        step=step,
        time_s=time.time(),
        world_size=ctx.world_size,
        tree=captured.tree,
        tensors=tensors,
        chunks=stored,
        stats=stats,
        library=ctx.library,
        meta=captured.meta,
        lineage=ctx.lineage,
    )
    if drafted is not None:
        manifest.prerender_tensors(drafted.text)
    return manifest


def _tensors(
    stored_index: list[int], chunks: list[ChunkPlan], captured: Captured, ctx: SaveContext
) -> dict[str, TensorEntry]:
    """Each tensor's shard as extents of the stored chunks (``stored_index[ci]``: where chunk
    ``ci`` of the layout is stored)."""
    extents: list[tuple[Extent, ...]] = [()] * len(captured.items)  # per item, in order
    for ci, chunk in enumerate(chunks):
        off, stored = 0, stored_index[ci]
        for idx, _start, length in chunk.pieces:
            extents[idx] += (Extent(chunk=stored, offset=off, length=length),)
            off += length
    tensors = {}
    rank = ctx.rank
    for item, ext in zip(captured.items, extents):
        shard = Shard(offset=item.global_offset, shape=item.shape, extents=ext, rank=rank)
        tensors[item.key] = TensorEntry(
            key=item.key,
            kind=item.kind,
            dtype=item.dtype,
            global_shape=item.global_shape,
            shards=(shard,),
        )
    return tensors
