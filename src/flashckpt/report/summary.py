"""Numbers from the run journal: per-save records and a run summary with goodput and cost.

Rank 0's events (or events without a rank) give the timeline: saves, restores and crashes are
decided once for all ranks, so the other ranks' copies of them are not counted again. Bytes are
the exception: each rank writes its own part of a save, so a save's bytes are summed over the
``durable`` events of every rank (the landing tier of each).

A restore is counted once per restore, however many ``restore`` events it journals: the HF
integration, for one, restores the model, the optimizer and the RNG of one step separately, at
the moments the Trainer asks for them. Consecutive ``restore`` events of the same step from the
same process (no save or run start in between) are one restore, their seconds summed.

Steps lost after a crash are the last step the crashed run is known to have reached minus the
step restored next. The evidence is the ``crash_detected`` event's ``last_step`` (the run
marker's last tick), the engine's ``steps_lost``, and any step-carrying event of the crashed run
(``step`` ticks — one ``{"event": "step", "step": n}`` per training step or every few — as well
as ``step_time``, ``save_start``, ``staged``); the largest wins.
Optional journal extension read here: a ``bench`` (or ``device``) event, or any ``durable``
event, may carry ``raw_Bps`` (raw device write bandwidth, optionally with ``tier``) so the report
can compare checkpoint throughput with what the device can do.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flashckpt.errors import ConfigError
from flashckpt.journal import read_events, well_typed
from flashckpt.policy.interval import crash_history, primary_events
from flashckpt.report.restarts import restart_stats
from flashckpt.units import finite_number

Event = Mapping[str, Any]


def num(value: Any) -> float | None:
    """``value`` as a finite float of sane size, or ``None`` (:func:`units.finite_number`)."""
    return finite_number(value)


def load_events(root_or_events: str | Path | Iterable[Event]) -> list[Event]:
    """Events from a checkpoint root, a journal file, or an iterable of event dicts."""
    if isinstance(root_or_events, (str, Path)):
        path = Path(root_or_events)
        if not path.exists():
            raise ConfigError(
                f"{path} does not exist; pass a checkpoint root (holding journal.jsonl) "
                "or a journal file"
            )
        return list(read_events(path))
    return [e for e in root_or_events if isinstance(e, Mapping) and well_typed(e)]


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


def save_records(events: Iterable[Event]) -> list[SaveRecord]:
    """Group ``save_start``/``staged``/``durable``/``save_failed`` events by step, in order.

    Timing comes from rank 0; bytes are summed over the ranks (see the module docstring)."""
    all_events = list(events)
    evs = primary_events(all_events)
    t0 = float(evs[0]["t"]) if evs else 0.0
    by_step: dict[Any, dict[str, Any]] = {}
    for e in evs:
        name = e.get("event")
        if name not in ("save_start", "staged", "durable", "save_failed"):
            continue
        step, t = e.get("step"), float(e["t"])
        rec = by_step.setdefault(step, {"step": step, "start": None, "t": t, "tiers": []})
        if name == "save_start":
            rec["start"] = t
        elif name == "staged":
            rec["blocking_s"] = num(e.get("blocking_s"))
        elif name == "save_failed":
            rec["failed"] = str(e.get("error", "unknown error"))
        else:
            _add_durable(rec, e, t)
    _sum_ranks(by_step, all_events)
    return [_record(r, t0) for r in by_step.values()]


_BYTES = ("total_bytes", "new_bytes", "reused_bytes")


def _sum_ranks(by_step: dict[Any, dict[str, Any]], events: list[Event]) -> None:
    """Bytes of each save summed over the landing-tier ``durable`` event of every rank."""
    landing: dict[tuple[Any, Any], Event] = {}
    for e in events:
        if e.get("event") == "durable" and isinstance(e.get("rank"), int):
            landing.setdefault((e.get("step"), e.get("rank")), e)
    per_step: dict[Any, list[Event]] = defaultdict(list)
    for (step, _rank), e in landing.items():
        per_step[step].append(e)
    for step, parts in per_step.items():
        rec = by_step.get(step)
        if rec is None or len(parts) < 2:
            continue
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
        bg = num(e.get("background_s"))
        rec["bg"] = bg


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


def restores(evs: Iterable[Event]) -> list[dict[str, Any]]:
    """One ``{"t", "step", "seconds", "parts"}`` per restore (see the module docstring)."""
    out: list[dict[str, Any]] = []
    open_key: tuple[Any, Any] | None = None
    for e in evs:
        name = e.get("event")
        if name in ("save_start", "run_start", "crash_detected"):
            open_key = None
        if name != "restore":
            continue
        key = (e.get("pid"), e.get("step"))
        secs = num(e.get("seconds")) or 0.0
        if key == open_key and out:
            out[-1]["seconds"] += secs
            out[-1]["parts"] += 1
        else:
            out.append({"t": float(e["t"]), "step": e.get("step"), "seconds": secs, "parts": 1})
            open_key = key
    return out


@dataclass(frozen=True, kw_only=True)
class RunSummary:
    """The run in numbers. Times in seconds, sizes in bytes, cost in the price's currency.

    Goodput is ``useful_s / wall_s`` where

    - ``wall_s`` = time covered by the journal's runs (first to last event of each run) plus the
      downtime after every run that did not end cleanly (``restart_gap_s``); the idle time
      between a clean ``run_end`` and a later ``run_start`` is not counted;
    - ``useful_s`` = ``wall_s`` − ``blocking_s`` (training blocked by saves, ``staged``) −
      ``restore_s`` (``restore`` seconds) − ``lost_s`` (steps redone after a crash × mean step
      time; steps from ``steps_lost``, else ``crash_detected.last_step`` − the next restored
      step) − ``restart_gap_s``.

    ``cost`` = ``wall_s``/3600 × ``gpu_hour_price`` × ``gpus``; ``wasted_cost`` is the share of it
    not spent on useful training. Both are ``None`` without a price.

    Restart seconds (kill -> first resumed step, from ``restart`` events; see
    engine/runtime/restart.py): ``restarts_timed`` of them, the last, mean and max, and each part's
    last and mean value (``down``, ``start``, ``restore``, ``first_step``); ``takeovers`` of them
    were a warm standby's (their mean ``mean_takeover_s``; the others' ``mean_cold_restart_s``).
    """

    events: int
    runs: int = 0
    saves: int = 0
    saves_failed: int = 0
    saves_skipped: int = 0
    mean_blocking_s: float | None = None
    max_blocking_s: float | None = None
    blocking_s: float = 0.0
    mean_durable_s: float | None = None
    max_durable_s: float | None = None
    bytes_new: float = 0.0
    bytes_reused: float = 0.0
    mean_throughput_Bps: float | None = None
    raw_Bps: float | None = None
    restores: int = 0
    restore_s: float = 0.0
    crashes: int = 0
    corrupt: int = 0
    steps_lost: int = 0
    lost_s: float = 0.0
    restart_gap_s: float = 0.0
    restarts_timed: int = 0
    last_restart_s: float | None = None
    mean_restart_s: float | None = None
    max_restart_s: float | None = None
    restart_parts_last: dict[str, float] = field(default_factory=dict)
    restart_parts_mean: dict[str, float] = field(default_factory=dict)
    takeovers: int = 0  # restarts a warm standby took over (flashckpt run --standby 1)
    last_restart_takeover: bool = False
    mean_takeover_s: float | None = None
    mean_cold_restart_s: float | None = None
    step_time_s: float | None = None
    last_step: int | None = None
    last_durable_step: int | None = None
    observed_mtbf_s: float | None = None
    interval_s: float | None = None
    interval_reason: str | None = None
    # the governor's latest decision (engine/runtime/governor.py): how the next save runs
    governor_mode: str | None = None
    governor_reason: str | None = None
    governor_background_cost_s: float | None = None
    governor_foreground_cost_s: float | None = None
    wall_s: float = 0.0
    useful_s: float = 0.0
    goodput: float | None = None
    gpus: int = 1
    gpu_hour_price: float | None = None
    cost: float | None = None
    wasted_cost: float | None = None

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _mean(values: Iterable[float | None]) -> float | None:
    vs = [v for v in values if v is not None]
    return sum(vs) / len(vs) if vs else None


_STEP_EVIDENCE = ("step", "step_time", "save_start", "staged")


def _lost_steps(evs: list[Event]) -> int:
    """Steps redone after crashes (see the module docstring for the evidence used)."""
    crashes: list[dict[str, float | None]] = []
    loose = 0.0  # steps_lost events without a crash event before them
    reached: float | None = None  # the furthest step the current run is known to have reached
    before: float | None = None  # the same for the run before the latest run_start
    for e in evs:
        name, step = e.get("event"), num(e.get("step"))
        if name == "crash_detected":  # journaled next to the new run's run_start, either order
            known = [v for v in (reached, before, num(e.get("last_step"))) if v is not None]
            crashes.append({"reach": max(known) if known else None, "restored": None, "n": 0.0})
            reached = before = None
        elif name == "run_start":
            reached, before = None, reached
        elif name == "steps_lost":
            n = num(e.get("steps")) or 0.0
            if crashes:
                crashes[-1]["n"] = max(crashes[-1]["n"] or 0.0, n)
            else:
                loose += n
        elif name == "restore" and crashes and crashes[-1]["restored"] is None:
            crashes[-1]["restored"] = step
        if name in _STEP_EVIDENCE and step is not None:
            reached = step if reached is None else max(reached, step)
    lost = loose
    for c in crashes:
        reach, restored = c["reach"], c["restored"]
        marker = max(0.0, reach - restored) if reach is not None and restored is not None else 0.0
        lost += max(marker, c["n"] or 0.0)
    return int(lost)


def summarize(
    events: Iterable[Event], *, gpu_hour_price: float | None = None, gpus: int | None = None
) -> RunSummary:
    """Summarize journal ``events`` (see :class:`RunSummary` for the definitions)."""
    if gpu_hour_price is not None and (num(gpu_hour_price) is None or gpu_hour_price < 0):
        raise ConfigError(f"gpu_hour_price must be a number >= 0, got {gpu_hour_price!r}")
    if gpus is not None and (isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 1):
        raise ConfigError(f"gpus must be an int >= 1, got {gpus!r}")
    all_events = list(events)
    evs = primary_events(all_events)
    if gpus is None:
        ranks = {e.get("rank") for e in all_events if isinstance(e.get("rank"), int)}
        gpus = max(1, len(ranks))
    if not evs:
        return RunSummary(events=0, gpus=gpus, gpu_hour_price=gpu_hour_price)
    recs = save_records(all_events)
    kinds: dict[str, list[Event]] = defaultdict(list)
    for e in evs:
        kinds[str(e.get("event"))].append(e)
    hist = crash_history(evs)
    step_time = _mean(num(e.get("seconds")) for e in kinds["step_time"])
    lost_steps = _lost_steps(evs)
    blocking = sum(r.blocking_s or 0.0 for r in recs)
    restored = restores(evs)
    restore_s = sum(r["seconds"] for r in restored)
    lost_s = lost_steps * (step_time or 0.0)
    gap_s = sum(hist.gaps_s)
    wall = hist.uptime_s + gap_s
    useful = max(0.0, wall - blocking - restore_s - lost_s - gap_s)
    goodput = useful / wall if wall > 0 else None
    cost = wall / 3600.0 * gpu_hour_price * gpus if gpu_hour_price is not None else None
    steps = [v for v in (num(e.get("step")) for e in evs) if v is not None]
    durable_steps = [r.step for r in recs if r.durable_s is not None and r.step is not None]
    raw = [num(e.get("raw_Bps")) for e in evs if e.get("event") in ("bench", "device", "durable")]
    interval = kinds["interval"][-1] if kinds["interval"] else {}
    gov = kinds["governor"][-1] if kinds["governor"] else {}
    done = [r for r in recs if r.failed is None]
    rs = restart_stats(evs)
    return RunSummary(
        events=len(evs),
        runs=hist.runs,
        saves=len(done),
        saves_failed=len(recs) - len(done),
        saves_skipped=len(kinds["save_skipped"]),
        mean_blocking_s=_mean(r.blocking_s for r in done),
        max_blocking_s=max((r.blocking_s for r in done if r.blocking_s is not None), default=None),
        blocking_s=blocking,
        mean_durable_s=_mean(r.durable_s for r in done),
        max_durable_s=max((r.durable_s for r in done if r.durable_s is not None), default=None),
        bytes_new=sum(r.new_bytes or 0.0 for r in recs),
        bytes_reused=sum(r.reused_bytes or 0.0 for r in recs),
        mean_throughput_Bps=_mean(r.throughput_Bps for r in recs),
        raw_Bps=max((v for v in raw if v is not None), default=None),
        restores=len(restored),
        restore_s=restore_s,
        crashes=hist.failures,
        corrupt=len(kinds["corrupt"]),
        steps_lost=lost_steps,
        lost_s=lost_s,
        restart_gap_s=gap_s,
        restarts_timed=rs.count,
        last_restart_s=rs.last_s,
        mean_restart_s=rs.mean_s,
        max_restart_s=rs.max_s,
        restart_parts_last=rs.parts_last,
        restart_parts_mean=rs.parts_mean,
        takeovers=rs.takeovers,
        last_restart_takeover=rs.last_takeover,
        mean_takeover_s=rs.takeover_mean_s,
        mean_cold_restart_s=rs.cold_mean_s,
        step_time_s=step_time,
        last_step=int(max(steps)) if steps else None,
        last_durable_step=max(durable_steps, default=None),
        observed_mtbf_s=hist.uptime_s / hist.failures if hist.failures else None,
        interval_s=num(interval.get("interval_s")),
        interval_reason=str(interval["reason"]) if "reason" in interval else None,
        governor_mode=str(gov["next"])[:20] if "next" in gov else None,
        governor_reason=str(gov["why"])[:200] if "why" in gov else None,
        governor_background_cost_s=num(gov.get("background_cost_s")),
        governor_foreground_cost_s=num(gov.get("foreground_cost_s")),
        wall_s=wall,
        useful_s=useful,
        goodput=goodput,
        gpus=gpus,
        gpu_hour_price=gpu_hour_price,
        cost=cost,
        wasted_cost=cost * (1.0 - goodput) if cost is not None and goodput is not None else None,
    )
