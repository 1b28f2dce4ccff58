"""Who writes what: global vs per-rank state, and one owner per replicated tensor.

**The per-rank rule.** Top-level state entries that are an ``nn.Module`` or a
``torch.optim.Optimizer`` are *global*: their DTensors (FSDP2, tensor parallel) are saved as this
rank's shard at its global offset, and their plain tensors are taken to be identical on every
rank (DDP, or scalars such as Adam's ``step``) and written once, by an owner rank. Every other
entry (RNG, sampler / data position, schedulers, GradScaler, user dicts) is *per-rank*: each
rank saves its own copy; its tensors are stored under ``"<key>@rank<r>"`` and its tree under
``manifest.rank_trees[str(r)]``, while ``manifest.tree`` holds rank 0's full tree.

**Owners** are chosen by greedy byte balancing over the replicated tensors sorted by (size
descending, key): each goes to the rank with the fewest bytes so far (lowest rank on ties).
Every rank computes the same assignment from its own keys, without communication. A DTensor
replicated over some mesh dimensions and sharded over others is written by the ranks at
coordinate 0 of the replicated dimensions.
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping
from typing import Any

import torch

from flashckpt.state.capture import Captured, TensorItem
from flashckpt.state.dtensor import is_dtensor

_TAGS = ("__t__", "__np__")


def per_rank_key(key: str, rank: int) -> str:
    return f"{key}@rank{rank}"


def global_entries(state: Mapping[str, Any]) -> set[str]:
    """Names of the entries whose tensors are global (modules and optimizers)."""
    return {
        name
        for name, value in state.items()
        if isinstance(value, (torch.nn.Module, torch.optim.Optimizer))
    }


def assign_owners(sizes: Mapping[str, int], world_size: int) -> dict[str, int]:
    """Owner rank of each replicated key: greedy largest-first byte balancing."""
    heap = [(0, r) for r in range(world_size)]
    owners: dict[str, int] = {}
    for key, size in sorted(sizes.items(), key=lambda kv: (-kv[1], kv[0])):
        load, r = heapq.heappop(heap)
        owners[key] = r
        heapq.heappush(heap, (load + size, r))
    return owners


def split_for_rank(
    captured: Captured, state: Mapping[str, Any], *, rank: int, world_size: int
) -> list[str]:
    """Keep only what this rank writes (in place); returns the names of per-rank entries.

    Per-rank entries get their tensor keys suffixed with ``@rank<r>`` in items and tree alike.
    """
    glob = global_entries(state)
    per_rank = [name for name in captured.tree if name not in glob]
    replicated = {i.key: i.nbytes for i in captured.items if _top(i.key) in glob and _is_rep(i)}
    owners = assign_owners(replicated, world_size)
    renames: dict[str, str] = {}
    kept: list[TensorItem] = []
    for item in captured.items:
        if _top(item.key) not in glob:
            renames[item.key] = per_rank_key(item.key, rank)
            item.key = renames[item.key]
        elif item.key in owners:
            if owners[item.key] != rank:
                continue
        elif not _writes_partial_replica(item):
            continue
        kept.append(item)
    captured.items = kept
    for name in per_rank:
        captured.tree[name] = rename_refs(captured.tree[name], renames)
    return per_rank


def rename_refs(tree: Any, renames: Mapping[str, str]) -> Any:
    """A copy of a JSON state tree with tensor references renamed."""
    if isinstance(tree, dict):
        if len(tree) == 1:
            tag = next(iter(tree))
            if tag in _TAGS and isinstance(tree[tag], str):
                return {tag: renames.get(tree[tag], tree[tag])}
        return {k: rename_refs(v, renames) for k, v in tree.items()}
    if isinstance(tree, list):
        return [rename_refs(v, renames) for v in tree]
    return tree


def _top(key: str) -> str:
    return key.split("/", 1)[0]


def _is_rep(item: TensorItem) -> bool:
    """Plain tensors and arrays of a global entry, and fully replicated DTensors."""
    return item.replicated or item.kind == "numpy" or not is_dtensor(item.source)


def _writes_partial_replica(item: TensorItem) -> bool:
    """For a DTensor sharded on some mesh dims and replicated on others (HSDP): True on the
    ranks at coordinate 0 of every replicated dim, so each shard box is written once."""
    if not is_dtensor(item.source):
        return True
    from torch.distributed.tensor import Replicate

    dt: Any = item.source
    coord = dt.device_mesh.get_coordinate()
    if coord is None:
        return False
    return all(c == 0 for c, p in zip(coord, dt.placements) if isinstance(p, Replicate))
