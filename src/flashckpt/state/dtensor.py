"""DTensor support: a DTensor is saved as this rank's local shard plus where it sits."""

from __future__ import annotations

import sys
from typing import Any

import torch

from flashckpt.errors import UnsupportedStateError


def _dtensor_type() -> type | None:
    """DTensor's class when torch's DTensor module is loaded, else None: no tensor can be a
    DTensor before that module ran, so this never imports it (the import took 1-1.5 s here,
    paid by the first save or restore of every process that saves plain tensors)."""
    api = sys.modules.get("torch.distributed.tensor._api")
    cls = getattr(api, "DTensor", None)
    return cls if isinstance(cls, type) else None


def is_dtensor(t: Any) -> bool:
    cls = _dtensor_type()
    return cls is not None and isinstance(t, cls)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's local tensor of a DTensor (``t`` itself otherwise), without the shard
    geometry :func:`local_shard` computes."""
    return t.to_local() if is_dtensor(t) else t  # type: ignore[attr-defined, no-any-return]


def local_shard(
    t: torch.Tensor, key: str
) -> tuple[torch.Tensor, tuple[int, ...], tuple[int, ...], bool]:
    """``(local_tensor, global_shape, global_offset, replicated)`` for a tensor or DTensor.

    ``replicated`` is True when every rank holds the same bytes (a fully replicated DTensor),
    so the distributed layer may let a single rank write them. A DTensor is validated first
    (:func:`check_placements`): nothing is saved that would not merge back exactly.
    """
    if not is_dtensor(t):
        if type(t) not in (torch.Tensor, torch.nn.Parameter, torch.nn.Buffer):
            plain = getattr(t, "as_subclass", None)
            if plain is None:
                raise UnsupportedStateError(f"tensor {key!r} of type {type(t)} is not supported")
            t = t.as_subclass(torch.Tensor)
        return t, tuple(t.shape), (0,) * t.dim(), False
    from torch.distributed.tensor import Replicate

    dt: Any = t
    local = local_tensor(dt)
    shape, offset = check_placements(dt, key)
    if tuple(shape) != tuple(local.shape):
        raise UnsupportedStateError(
            f"DTensor {key!r}: local shard shape {tuple(local.shape)} does not match its "
            f"placement {dt.placements} (uneven or partial shards are not supported)"
        )
    replicated = all(isinstance(p, Replicate) for p in dt.placements)
    return local, tuple(dt.shape), tuple(int(o) for o in offset), replicated


def check_placements(dt: Any, key: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(local_shape, global_offset)`` of this rank's shard of DTensor ``dt``, or
    UnsupportedStateError when the shard cannot be saved as one box of the global tensor.

    ``Partial`` (a pending sum or average) is refused: each rank holds a summand, not a shard.
    ``_StridedShard`` (FSDP2 over tensor parallel) is accepted when the rank's indices along
    every dimension are contiguous, as FSDP2+TP's ``(_StridedShard, Shard)`` layouts are;
    indices are computed exactly, the way DTensor distributes, and a strided layout that is
    not a box is refused.
    """
    from torch.distributed.tensor import Partial
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    from torch.distributed.tensor.placement_types import _StridedShard

    if any(isinstance(p, Partial) for p in dt.placements):
        raise UnsupportedStateError(
            f"DTensor {key!r} has placements {tuple(dt.placements)}: a Partial placement holds "
            "a pending reduction (each rank a summand), not a shard. Reduce it before saving, "
            "e.g. t.redistribute(placements=[Replicate()]) or t.full_tensor()"
        )
    shape, offset = compute_local_shape_and_global_offset(dt.shape, dt.device_mesh, dt.placements)
    if any(isinstance(p, _StridedShard) for p in dt.placements):
        _check_box(dt, key)
    return tuple(int(s) for s in shape), tuple(int(o) for o in offset)


def _check_box(dt: Any, key: str) -> None:
    """Refuse a shard whose global indices along some dimension are not contiguous."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.placement_types import _StridedShard, _StridedShardOffsetMode

    coord = dt.device_mesh.get_coordinate()
    if coord is None:
        return
    index: dict[int, torch.Tensor] = {}
    for mesh_dim, p in enumerate(dt.placements):
        if not isinstance(p, (Shard, _StridedShard)):
            continue
        prev = index.get(p.dim, torch.arange(dt.shape[p.dim]))
        n, c = dt.device_mesh.size(mesh_dim), coord[mesh_dim]
        if isinstance(p, _StridedShard):
            _, offs = p.local_shard_size_and_offset(len(prev), n, c, _StridedShardOffsetMode.ALL)
            index[p.dim] = prev[torch.tensor(offs, dtype=torch.long)]
        else:
            size, start = Shard.local_shard_size_and_offset(len(prev), n, c)
            index[p.dim] = prev[int(start) : int(start) + int(size)]
    for dim, idx in index.items():
        if len(idx) > 1 and not torch.equal(idx, torch.arange(int(idx[0]), int(idx[0]) + len(idx))):
            raise UnsupportedStateError(
                f"DTensor {key!r} with placements {tuple(dt.placements)}: this rank's shard "
                f"holds non-contiguous indices {idx.tolist()[:8]}... of dimension {dim}, so it "
                "is not one box of the global tensor and cannot be saved exactly. "
                "Redistribute it to Shard/Replicate placements before saving"
            )
