"""Restart seconds from the journal's ``restart`` events (engine/runtime/restart.py): last, mean,
max, and the mean and last of each part (down, start, restore, first step); and apart, the
restarts a warm standby took over (``takeover: true``: their down and start are the standby's
wait and the opening of its Checkpointer) and the cold ones (a new process)."""

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
    takeovers: int = 0  # of ``count``: a warm standby took over
    last_takeover: bool = False
    takeover_mean_s: float | None = None
    cold_mean_s: float | None = None


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
    warm = [float(e["restart_seconds"]) for e in rows if e.get("takeover") is True]
    cold = [float(e["restart_seconds"]) for e in rows if e.get("takeover") is not True]
    return RestartStats(
        takeovers=len(warm),
        last_takeover=rows[-1].get("takeover") is True,
        takeover_mean_s=statistics.fmean(warm) if warm else None,
        cold_mean_s=statistics.fmean(cold) if cold else None,
        count=len(rows),
        last_s=totals[-1],
        mean_s=statistics.fmean(totals),
        max_s=max(totals),
        parts_last=last,
        parts_mean=means,
    )


def describe_parts(parts: Mapping[str, float], fmt: Any, *, takeover: bool = False) -> str:
    """``down 0.1 s · start 2.3 s · restore 0.4 s · first step 0.2 s``; for a takeover
    ``wait 0.1 s · open 0.1 s · restore ...`` (what down and start are for a standby)."""
    names = {"down": "wait", "start": "open"} if takeover else {}
    return " · ".join(
        f"{names.get(p, p.replace('_', ' '))} {fmt(parts[p])}" for p in PARTS if p in parts
    )


def describe_takeovers(
    *,
    count: int,
    takeovers: int,
    takeover_mean_s: float | None,
    cold_mean_s: float | None,
    fmt: Any,
) -> str:
    """``2 by a warm standby (mean 1.1 s), 1 cold (mean 8.9 s)``; "" without a takeover."""
    if not takeovers:
        return ""
    cold = count - takeovers
    return f"{takeovers} by a warm standby (mean {fmt(takeover_mean_s)})" + (
        f", {cold} cold (mean {fmt(cold_mean_s)})" if cold and cold_mean_s is not None else ""
    )
