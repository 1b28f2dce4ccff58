"""Chunk layout: which bytes of which tensors go into which chunk.

Large tensors are cut at fixed offsets (multiples of ``chunk_bytes``) so an unchanged region maps
to the same chunk from save to save. Tensors smaller than ``pack_threshold_bytes`` are packed
together in key order into chunks of at most ``pack_bytes``, so ten thousand biases become a
handful of files. Chunks never mix devices.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch

from flashckpt.state.capture import TensorItem


class Piece(NamedTuple):
    """``length`` bytes at ``start`` of item number ``item``'s data (a tuple: a save makes one
    per small tensor, and a tuple is the cheapest immutable record to make)."""

    item: int  # index into the save's items
    start: int  # byte offset inside the item's data
    length: int


@dataclass(kw_only=True)
class ChunkPlan:
    pieces: list[Piece] = field(default_factory=list)
    size: int = 0
    device: str = "cpu"
    itemsize: int = 1  # element size when the chunk holds one dtype (for byte shuffling)


def plan_chunks(
    items: list[TensorItem],
    *,
    chunk_bytes: int,
    pack_bytes: int,
    pack_threshold_bytes: int,
    itemsizes: list[int],
    device_of: Callable[[torch.Tensor], str] = lambda t: str(t.device),
) -> list[ChunkPlan]:
    chunks: list[ChunkPlan] = []
    packs: dict[str, ChunkPlan] = {}
    for idx, item in enumerate(items):
        n = item.data.numel()  # (item.nbytes, without the property call)
        dev = device_of(item.data)
        if n < pack_threshold_bytes:
            pack = packs.get(dev)
            if pack is None or pack.size + n > pack_bytes:
                pack = ChunkPlan(device=dev, itemsize=itemsizes[idx])
                packs[dev] = pack
                chunks.append(pack)
            if pack.itemsize != itemsizes[idx]:
                pack.itemsize = 1
            pack.pieces.append(Piece(idx, 0, n))
            pack.size += n
            continue
        for start in range(0, n, chunk_bytes):
            length = min(chunk_bytes, n - start)
            chunks.append(
                ChunkPlan(
                    pieces=[Piece(item=idx, start=start, length=length)],
                    size=length,
                    device=dev,
                    itemsize=itemsizes[idx],
                )
            )
    return chunks


SMALL_PIECE_BYTES = 4096


def joined(views: list[np.ndarray], size: int) -> list[np.ndarray]:
    """The ``size`` bytes of a chunk's pieces ``views`` as one array when they are many and
    small on average: one copy of a few KiB costs less than what each piece costs on its own
    (a hash update, a write call: about 1.5 us for each 64-byte tensor of a pack). Pieces of
    larger tensors are handed on as they are (every byte moves once)."""
    if len(views) > 1 and size <= SMALL_PIECE_BYTES * len(views):
        return [np.concatenate(views)]
    return views
