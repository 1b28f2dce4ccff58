"""The tiers' health in the journal: damage the idle scrub found (``scrub_damage``), checkpoint
copies lineage abandoned (``abandoned_copy``) and what the scrub read (``scrubbed``), folded one
event at a time from every rank (not only rank 0's, like the timeline).

Each tier has one scrubber under torch.distributed (a node tier its node's leader, the disk
rank 0: engine/tiers/scrubbing.py), so every rank's ``scrub_damage`` and ``scrubbed`` count. An
abandoned copy of a tier every rank reads (disk, remote, a memory tier the ranks share) is
journaled by each rank that restored: rank 0's (or a single process's) is counted; a node
tier's copy is journaled once, by its node's leader (with ``node``), and counts from any rank.
The counts do not depend on the order events are folded in.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from flashckpt.units import finite_number

Event = Mapping[str, Any]

TIER_EVENTS = frozenset(("scrub_damage", "abandoned_copy", "scrubbed"))


def counted(e: Event) -> bool:
    """True for a tier event that counts (module docstring); the others repeat one."""
    name = e.get("event")
    if name not in TIER_EVENTS or finite_number(e.get("t")) is None:
        return False
    if name == "abandoned_copy":
        return e.get("rank") in (None, 0) or isinstance(e.get("node"), str)
    return True


class TierHealthFold:
    """``scrub_damage``: chunks found damaged; ``abandoned``: copies skipped (and removed
    where the writer owns the tier); ``scrubbed_bytes`` / ``scrubbed_chunks``: read and
    verified by the idle scrub."""

    def __init__(self) -> None:
        self.scrub_damage = 0
        self.abandoned = 0
        self.scrubbed_bytes = 0.0
        self.scrubbed_chunks = 0

    def add(self, e: Event) -> None:
        if not counted(e):
            return
        name = e.get("event")
        if name == "scrub_damage":
            self.scrub_damage += 1
        elif name == "abandoned_copy":
            self.abandoned += 1
        else:
            b, n = finite_number(e.get("bytes")), finite_number(e.get("chunks"))
            self.scrubbed_bytes += b if b is not None and b > 0 else 0.0
            self.scrubbed_chunks += int(n) if n is not None and n > 0 else 0
