"""Per-save records from the journal, folded one event at a time (:class:`SaveFold`).

``save_start``/``staged``/``durable``/``save_failed`` events are grouped by step. Timing comes
from rank 0 (the primary events, in time order); bytes are summed over the ranks: each rank
writes its own part of a save, so a save's bytes are the sum over the landing-tier ``durable``
event of every rank (the first ``durable`` of each rank, in journal order).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from flashckpt.units import finite_number

Event = Mapping[str, Any]
_SAVE_EVENTS = frozenset(("save_start", "staged", "durable", "save_failed"))
_BYTES = ("total_bytes", "new_bytes", "reused_bytes")


def num(value: Any) -> float | None:
    """``value`` as a finite float of sane size, or ``None`` (:func:`units.finite_number`)."""
    return finite_number(value)


@dataclass(frozen=True, kw_only=True)
class SaveRecord:
    """One save: ``t_s`` seconds since the first event; ``durable_s`` from the save call until
    the slowest tier reported durable (``None`` if never); bytes from the first tier, summed
    over the ``ranks`` that wrote a part of it."""

    step: int | None
    t_s: float
    blocking_s: float | None = None
    durable_s: float | None = None
    tiers: tuple[str, ...] = ()
    ranks: int = 1
    total_bytes: float | None = None
    new_bytes: float | None = None
    reused_bytes: float | None = None
    throughput_Bps: float | None = None
    failed: str | None = None


class SaveFold:
    """The saves of a journal so far. :meth:`add_any` takes every event in journal order,
    :meth:`add_primary` the primary ones (rank 0 or no rank) in time order; :meth:`records`
    builds again only the records of the saves that changed since it was last called."""

    def __init__(self) -> None:
        self.t0: float | None = None
        self.by_step: dict[Any, dict[str, Any]] = {}
        self.landing: dict[Any, dict[int, Event]] = {}  # step -> rank -> its first durable
        self._dirty: set[Any] = set()
        self._records: dict[Any, SaveRecord] = {}

    def add_any(self, e: Event) -> None:
        rank = e.get("rank")
        if e.get("event") == "durable" and isinstance(rank, int):
            ranks = self.landing.setdefault(e.get("step"), {})
            if rank not in ranks:
                ranks[rank] = e
                self._dirty.add(e.get("step"))

    def add_primary(self, e: Event) -> None:
        t = float(e["t"])
        if self.t0 is None:
            self.t0 = t
        name = e.get("event")
        if name not in _SAVE_EVENTS:
            return
        step = e.get("step")
        rec = self.by_step.setdefault(step, {"step": step, "start": None, "t": t, "tiers": []})
        self._dirty.add(step)
        if name == "save_start":
            rec["start"] = t
        elif name == "staged":
            rec["blocking_s"] = num(e.get("blocking_s"))
        elif name == "save_failed":
            rec["failed"] = str(e.get("error", "unknown error"))
        else:
            _add_durable(rec, e, t)

    def records(self) -> list[SaveRecord]:
        t0 = self.t0 if self.t0 is not None else 0.0
        for step in self._dirty:
            if step in self.by_step:
                rec = dict(self.by_step[step])
                _sum_ranks(rec, list(self.landing.get(step, {}).values()))
                self._records[step] = _record(rec, t0)
        self._dirty.clear()
        return [self._records[step] for step in self.by_step]


def _sum_ranks(rec: dict[str, Any], parts: list[Event]) -> None:
    """A save's bytes summed over the landing-tier ``durable`` event of every rank."""
    if len(parts) < 2:
        return
    for key in _BYTES:
        vals = [num(p.get(key)) for p in parts]
        rec[key] = sum(v for v in vals if v is not None) if any(vals) else rec.get(key)
    slowest = max((num(p.get("background_s")) or 0.0 for p in parts), default=0.0)
    if rec.get("new_bytes") is not None and slowest > 0:
        rec["throughput_Bps"] = rec["new_bytes"] / slowest
    rec["ranks"] = len(parts)


def _add_durable(rec: dict[str, Any], e: Event, t: float) -> None:
    rec["tiers"].append(str(e.get("tier", "?")))
    rec["durable_t"] = max(t, rec.get("durable_t", t))
    if len(rec["tiers"]) == 1:  # the landing tier carries the new/reused split
        for key in ("total_bytes", "new_bytes", "reused_bytes", "throughput_Bps"):
            rec[key] = num(e.get(key))
        rec["bg"] = num(e.get("background_s"))


def _record(r: dict[str, Any], t0: float) -> SaveRecord:
    start = r["start"]
    if start is None and r.get("blocking_s") is not None:
        start = r["t"] - r["blocking_s"]
    durable = None
    if "durable_t" in r and start is not None:
        durable = max(0.0, r["durable_t"] - start)
    elif r.get("bg") is not None:
        durable = r["bg"] + (r.get("blocking_s") or 0.0)
    step = r["step"] if isinstance(r["step"], int) and not isinstance(r["step"], bool) else None
    return SaveRecord(
        step=step,
        t_s=(start if start is not None else r["t"]) - t0,
        blocking_s=r.get("blocking_s"),
        durable_s=durable,
        tiers=tuple(r["tiers"]),
        ranks=int(r.get("ranks", 1)),
        total_bytes=r.get("total_bytes"),
        new_bytes=r.get("new_bytes"),
        reused_bytes=r.get("reused_bytes"),
        throughput_Bps=r.get("throughput_Bps"),
        failed=r.get("failed"),
    )
