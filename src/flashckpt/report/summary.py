"""Numbers from the run journal: per-save records and a run summary with goodput and cost.

Rank 0's events (or events without a rank) give the timeline: saves, restores and crashes are
decided once for all ranks, so the other ranks' copies of them are not counted again. Bytes are
the exception: each rank writes its own part of a save, so a save's bytes are summed over the
``durable`` events of every rank (the landing tier of each).

A restore is counted once per restore, however many ``restore`` events it journals (see
:mod:`flashckpt.report.lost`).

Steps lost after a crash: see :mod:`flashckpt.report.lost`.

The summary is a fold (:class:`JournalFold`): events are added once, in pieces, and the summary
of what was added so far costs one pass over the saves, not over the events; a reader that
polls a growing journal (the Prometheus exporter) pays for what was appended.
Optional journal extension read here: a ``bench`` (or ``device``) event, or any ``durable``
event, may carry ``raw_Bps`` (raw device write bandwidth, optionally with ``tier``) so the report
can compare checkpoint throughput with what the device can do.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flashckpt.errors import ConfigError
from flashckpt.journal import read_events, well_typed
from flashckpt.policy.interval import RunSplitter
from flashckpt.report.lost import LostFold, RestoreFold
from flashckpt.report.restarts import restart_stats
from flashckpt.report.saves import Event, SaveFold, SaveRecord, num
from flashckpt.report.tierhealth import TierHealthFold

__all__ = ["Event", "JournalFold", "RunSummary", "SaveRecord", "load_events", "num", "summarize"]


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

    Tier health (every rank's, see :mod:`flashckpt.report.tierhealth`): ``scrub_damage``
    chunks the idle scrub found damaged, ``abandoned_copies`` checkpoint copies lineage
    abandoned (skipped by restore), ``scrubbed_bytes`` / ``scrubbed_chunks`` the scrub verified.

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
    scrub_damage: int = 0
    abandoned_copies: int = 0
    scrubbed_bytes: float = 0.0
    scrubbed_chunks: int = 0
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


def _primary(e: Event) -> bool:
    return e.get("rank") in (None, 0) and num(e.get("t")) is not None


class JournalFold:
    """A journal's summary, built from its events added in pieces (:meth:`extend`).

    Events come in journal order. The primary ones (rank 0 or no rank: the timeline) must be
    folded in time order: each piece's are sorted, and a piece that reaches back before the
    newest primary event already folded makes the fold start over from every event it holds
    (so the result is always the one :func:`summarize` gives for all of them)."""

    def __init__(self) -> None:
        self.events: list[Event] = []
        self.folded = 0  # events folded in, counting those folded again after a start-over
        self._reset()

    def _reset(self) -> None:
        self.primary = 0
        self.ranks: set[int] = set()
        self.saves = SaveFold()
        self.split = RunSplitter()
        self.lost = LostFold()
        self.restored = RestoreFold()
        self.health = TierHealthFold()  # every rank's (report/tierhealth.py)
        self.step_times: list[float] = []
        self.counts = {"save_skipped": 0, "corrupt": 0}
        self.latest: dict[str, Event] = {}  # the newest interval / governor event
        self.restart_rows: list[Event] = []
        self.max_step: float | None = None
        self.raw: float | None = None
        self.last_t = float("-inf")

    def extend(self, events: Iterable[Event]) -> JournalFold:
        new = list(events)
        self.events.extend(new)
        self.folded += len(new)
        primaries = sorted((e for e in new if _primary(e)), key=lambda e: float(e["t"]))
        if primaries and float(primaries[0]["t"]) < self.last_t:
            everything = self.events
            self.events = []
            self._reset()
            return self.extend(everything)
        for e in new:
            rank = e.get("rank")
            if isinstance(rank, int):
                self.ranks.add(rank)
            self.saves.add_any(e)
            self.health.add(e)
        for e in primaries:
            self._add_primary(e)
        return self

    def _add_primary(self, e: Event) -> None:
        self.primary += 1
        self.last_t = float(e["t"])
        self.saves.add_primary(e)
        self.split.add(e)
        self.lost.add(e)
        self.restored.add(e)
        name = e.get("event")
        if name == "step_time":
            secs = num(e.get("seconds"))
            if secs is not None:
                self.step_times.append(secs)
        elif name in self.counts:
            self.counts[str(name)] += 1
        elif name in ("interval", "governor"):
            self.latest[str(name)] = e
        elif name == "restart":
            self.restart_rows.append(e)
        step = num(e.get("step"))
        if step is not None and (self.max_step is None or step > self.max_step):
            self.max_step = step
        if name in ("bench", "device", "durable"):
            raw = num(e.get("raw_Bps"))
            if raw is not None and (self.raw is None or raw > self.raw):
                self.raw = raw

    def save_records(self) -> list[SaveRecord]:
        return self.saves.records()

    def summary(
        self, *, gpu_hour_price: float | None = None, gpus: int | None = None
    ) -> RunSummary:
        """The summary of every event added so far (:func:`summarize` checks the arguments)."""
        if gpus is None:
            gpus = max(1, len(self.ranks))
        if not self.primary:
            return RunSummary(events=0, gpus=gpus, gpu_hour_price=gpu_hour_price)
        recs = self.saves.records()
        hist = self.split.history()
        step_time = _mean(self.step_times)
        lost_steps = self.lost.steps()
        blocking = sum(r.blocking_s or 0.0 for r in recs)
        restore_s = sum(r["seconds"] for r in self.restored.rows)
        lost_s = lost_steps * (step_time or 0.0)
        gap_s = sum(hist.gaps_s)
        wall = hist.uptime_s + gap_s
        useful = max(0.0, wall - blocking - restore_s - lost_s - gap_s)
        goodput = useful / wall if wall > 0 else None
        cost = wall / 3600.0 * gpu_hour_price * gpus if gpu_hour_price is not None else None
        durable_steps = [r.step for r in recs if r.durable_s is not None and r.step is not None]
        interval = self.latest.get("interval", {})
        gov = self.latest.get("governor", {})
        done = [r for r in recs if r.failed is None]
        rs = restart_stats(self.restart_rows)
        return RunSummary(
            events=self.primary,
            runs=hist.runs,
            saves=len(done),
            saves_failed=len(recs) - len(done),
            saves_skipped=self.counts["save_skipped"],
            mean_blocking_s=_mean(r.blocking_s for r in done),
            max_blocking_s=max(
                (r.blocking_s for r in done if r.blocking_s is not None), default=None
            ),
            blocking_s=blocking,
            mean_durable_s=_mean(r.durable_s for r in done),
            max_durable_s=max((r.durable_s for r in done if r.durable_s is not None), default=None),
            bytes_new=sum(r.new_bytes or 0.0 for r in recs),
            bytes_reused=sum(r.reused_bytes or 0.0 for r in recs),
            mean_throughput_Bps=_mean(r.throughput_Bps for r in recs),
            raw_Bps=self.raw,
            restores=len(self.restored.rows),
            restore_s=restore_s,
            crashes=hist.failures,
            corrupt=self.counts["corrupt"],
            scrub_damage=self.health.scrub_damage,
            abandoned_copies=self.health.abandoned,
            scrubbed_bytes=self.health.scrubbed_bytes,
            scrubbed_chunks=self.health.scrubbed_chunks,
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
            last_step=int(self.max_step) if self.max_step is not None else None,
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
            wasted_cost=cost * (1.0 - goodput)
            if cost is not None and goodput is not None
            else None,
        )


def save_records(events: Iterable[Event]) -> list[SaveRecord]:
    """The saves of ``events`` in order (see :mod:`flashckpt.report.saves`)."""
    return JournalFold().extend(events).save_records()


def summarize(
    events: Iterable[Event], *, gpu_hour_price: float | None = None, gpus: int | None = None
) -> RunSummary:
    """Summarize journal ``events`` (see :class:`RunSummary` for the definitions)."""
    if gpu_hour_price is not None and (num(gpu_hour_price) is None or gpu_hour_price < 0):
        raise ConfigError(f"gpu_hour_price must be a number >= 0, got {gpu_hour_price!r}")
    if gpus is not None and (isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 1):
        raise ConfigError(f"gpus must be an int >= 1, got {gpus!r}")
    return JournalFold().extend(events).summary(gpu_hour_price=gpu_hour_price, gpus=gpus)
