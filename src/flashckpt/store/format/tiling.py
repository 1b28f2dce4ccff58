"""Do a tensor's shards tile it exactly? (load-side validation of a manifest)

A manifest's shards are boxes ``(offset, shape)`` inside the tensor's global shape. Restore
copies each box into place, so a gap would leave uninitialised memory in the restored tensor and
an overlap means two saved copies disagree about who holds which elements. Boxes are checked
pairwise (a sweep along dimension 0, so row-sharded FSDP/DTensor layouts cost O(n log n)), not
just by adding up volumes; the work is bounded so a hostile manifest cannot make it slow.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offset, shape)
MAX_COMPARISONS = 4_000_000


def _overlap(a: Box, b: Box) -> bool:
    return all(
        ao < bo + bn and bo < ao + an for ao, an, bo, bn in zip(a[0], a[1], b[0], b[1], strict=True)
    )


def find_overlap(boxes: Sequence[Box]) -> tuple[Box, Box] | str | None:
    """Two boxes that share an element, a message when the check would be too costly, or
    None. Empty boxes never overlap anything."""
    live = sorted((b for b in boxes if math.prod(b[1]) > 0), key=lambda b: b[0][:1])
    if live and not live[0][0]:  # 0-d tensors: any two non-empty boxes are the same element
        return (live[0], live[1]) if len(live) > 1 else None
    active: list[Box] = []
    budget = MAX_COMPARISONS
    for box in live:
        start = box[0][0]
        active = [a for a in active if a[0][0] + a[1][0] > start]
        budget -= len(active)
        if budget < 0:
            return f"more than {len(boxes)} shards overlap along dimension 0; too many to check"
        for other in active:
            if _overlap(other, box):
                return other, box
        active.append(box)
    return None


def check_tiling(gshape: tuple[int, ...], boxes: Sequence[Box], *, whole: bool) -> str | None:
    """None when the boxes never overlap and (``whole``) cover all of ``gshape``; otherwise
    what is wrong. Boxes are assumed inside ``gshape`` (the manifest parser checks that)."""
    found = find_overlap(boxes)
    if isinstance(found, str):
        return found
    if found is not None:
        (ao, an), (bo, bn) = found
        return f"shards at offset {list(ao)} shape {list(an)} and {list(bo)} {list(bn)} overlap"
    if whole:
        covered = sum(math.prod(shape) for _, shape in boxes)
        total = math.prod(gshape)
        if covered != total:
            return (
                f"its shards cover {covered} of its {total} elements (a gap: the missing "
                "elements would be uninitialised memory)"
            )
    return None
