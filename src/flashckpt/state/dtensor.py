"""DTensor support: a DTensor is saved as this rank's local shard plus where it sits."""

from __future__ import annotations

from typing import Any

import torch

from flashckpt.errors import UnsupportedStateError


def _dtensor_type() -> type | None:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch built without distributed
        return None
    return DTensor


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
    so the distributed layer may let a single rank write them.
    """
    if not is_dtensor(t):
        if type(t) not in (torch.Tensor, torch.nn.Parameter, torch.nn.Buffer):
            plain = getattr(t, "as_subclass", None)
            if plain is None:
                raise UnsupportedStateError(f"tensor {key!r} of type {type(t)} is not supported")
            t = t.as_subclass(torch.Tensor)
        return t, tuple(t.shape), (0,) * t.dim(), False
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    dt: Any = t
    local = local_tensor(dt)
    shape, offset = compute_local_shape_and_global_offset(dt.shape, dt.device_mesh, dt.placements)
    if tuple(shape) != tuple(local.shape):
        raise UnsupportedStateError(
            f"DTensor {key!r}: local shard shape {tuple(local.shape)} does not match its "
            f"placement {dt.placements} (uneven or partial shards are not supported)"
        )
    replicated = all(isinstance(p, Replicate) for p in dt.placements)
    return local, tuple(dt.shape), tuple(int(o) for o in offset), replicated
