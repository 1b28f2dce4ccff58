"""Restart seconds from the journal's ``restart`` events (engine/runtime/restart.py): last, mean,
max, and the mean and last of each part (down, start, restore, first step)."""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from flashckpt.units import finite_number

PARTS = ("down", "start", "restore", "first_step")


def _num(value: Any) -> float | None:
    v = finite_number(value)
    return v if v is not None and v >= 0 else None


@dataclass(frozen=True, kw_only=True)
class RestartStats:
    """``count`` timed restarts; ``parts_last`` / ``parts_mean`` map each of :data:`PARTS` to
    seconds (a part missing from every restart, e.g. restore with no checkpoint, is absent)."""

    count: int = 0
    last_s: float | None = None
    mean_s: float | None = None
    max_s: float | None = None
    parts_last: dict[str, float] = field(default_factory=dict)
    parts_mean: dict[str, float] = field(default_factory=dict)


def restart_stats(evs: Iterable[Mapping[str, Any]]) -> RestartStats:
    """Aggregate the ``restart`` events of the primary writer (pass primary events)."""
    rows = [e for e in evs if e.get("event") == "restart"]
    rows = [e for e in rows if _num(e.get("restart_seconds")) is not None]
    if not rows:
        return RestartStats()
    totals = [float(e["restart_seconds"]) for e in rows]
    means: dict[str, float] = {}
    for p in PARTS:
        vals = [v for v in (_num(e.get(f"{p}_s")) for e in rows) if v is not None]
        if vals:
            means[p] = statistics.fmean(vals)
    last = {p: v for p in PARTS if (v := _num(rows[-1].get(f"{p}_s"))) is not None}
    return RestartStats(
        count=len(rows),
        last_s=totals[-1],
        mean_s=statistics.fmean(totals),
        max_s=max(totals),
        parts_last=last,
        parts_mean=means,
    )


def describe_parts(parts: Mapping[str, float], fmt: Any) -> str:
    """``down 0.1 s · start 2.3 s · restore 0.4 s · first step 0.2 s``."""
    return " · ".join(f"{p.replace('_', ' ')} {fmt(parts[p])}" for p in PARTS if p in parts)
