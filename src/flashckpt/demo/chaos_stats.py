"""Goodput of one chaos-benchmark method, from its training log and the kill times (pure).

The log is the JSON lines of :mod:`flashckpt.demo.chaos_train`: each process appends a
``start`` record (restored step, process-start / import / restore times) then one ``step``
record per step (compute and blocking seconds). Processes follow each other in the log.

- **Useful work**: a step counts once, in the process whose work survived — process ``k``'s
  steps up to the step process ``k+1`` restored from (later ones were lost and redone). Useful
  time = surviving steps × the undisturbed step time ``base_step_s`` (the median step of the
  baseline run, which trains with no checkpointing at all on the same machine), so whatever
  checkpointing costs a step — a wait for staging, background copies competing for the cores
  — counts as waste. Without a baseline the median step of the run itself stands in.
- **Goodput** = useful time / wall time of the run.
- **Restart** (per kill): kill → first completed step of the next process, split into process
  (kill → spawn), imports (interpreter start and imports), build (model and optimizer), restore
  (opening the checkpointer and loading), and the first step. The kill instant is the
  driver's, exact. For the flashckpt method, pass its ``journal``: the ``restart`` events
  (engine/runtime/restart.py) give ``journal_restart_s`` and the mean parts
  ``journal_restart_parts_s`` (down, start, restore, first_step), what ``status`` and the
  report show; ``restart_journaled`` counts them. The journal cannot know the kill instant (its
  kill is the killed run's last sign of life, up to a step early), so ``restart_s`` stays the
  log's. A journaled restart
  whose kill instant precedes the kill before this one spans two failures (a restarted
  process killed before it opened its Checkpointer leaves no trace in the journal); the log's
  figure is used alone for it. A warm standby's process (``flashckpt_standby``: ``standby``
  in its start record) was started before the kill it replaces: its kill is the last one
  before its first step, and everything from the kill to the end of its ``restore()`` (the
  wait, opening the Checkpointer, loading) is its restore part (process, imports, build: 0).
- **Daly's model** at the measured save cost ``C`` = (seconds the steps took beyond
  ``base_step_s``, blocking included, over every step but each process's first) / saves, the
  measured restart ``R`` less one undisturbed step (the first resumed step is useful work),
  failure rate (wall / failures) and mean seconds of work between saves ``τ``:
  ``1 − expected_waste_fraction(τ, C, M, R)``; ``best_model_goodput`` is the same at the
  method's own optimal ``τ`` (``optimal_interval_s(C, M)``): what it would reach saving at
  the Young/Daly interval of its measured cost, the comparison the issue asks for.
"""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from flashckpt.policy.interval import expected_waste_fraction, optimal_interval_s


@dataclass(kw_only=True)
class Run:
    start: Mapping[str, Any]
    steps: list[Mapping[str, Any]] = field(default_factory=list)


@dataclass(kw_only=True)
class MethodResult:
    goodput: float
    model_goodput: float | None
    best_model_goodput: float | None  # Daly's model at this method's own optimal interval
    wall_s: float
    useful_s: float
    failures: int
    steps_done: int
    steps_lost: int
    saves: int
    save_blocking_s: float
    save_cost_s: float
    base_step_s: float
    interval_s: float | None
    restore_s: list[float]
    restart_s: list[float]
    journal_restart_s: list[float]
    restart_parts_s: dict[str, float]
    restart_journaled: int
    journal_restart_parts_s: dict[str, float]
    cold_start_s: float | None
    restart_ratio: float | None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def split_runs(records: Sequence[Mapping[str, Any]]) -> list[Run]:
    runs: list[Run] = []
    for rec in records:
        if rec.get("event") == "start":
            runs.append(Run(start=rec))
        elif rec.get("event") == "step" and runs:
            runs[-1].steps.append(rec)
    return runs


def surviving(runs: Sequence[Run]) -> list[Mapping[str, Any]]:
    """The step records whose work the final model contains, in order."""
    out: list[Mapping[str, Any]] = []
    for k, run in enumerate(runs):
        limit = runs[k + 1].start["step"] if k + 1 < len(runs) else None
        out.extend(r for r in run.steps if limit is None or r["step"] <= limit)
    return out


def _restarts(
    runs: Sequence[Run],
    kills: Sequence[float],
    t_spawn0: float,
    journaled: dict[Any, Mapping[str, Any]],
) -> tuple[list[float], dict[str, list[float]], float | None]:
    """Restart seconds (kill -> first step) per kill that was followed by a resumed step
    (journaled entries that span two failures are removed from ``journaled``); the parts; cold
    start."""
    parts: dict[str, list[float]] = {
        "process": [],
        "imports": [],
        "build": [],
        "restore": [],
        "first_step": [],
    }
    restart: list[float] = []
    cold = None
    if runs and runs[0].steps:
        cold = runs[0].steps[0]["t"] - t_spawn0
    for run in runs[1:]:
        s = run.start
        if not run.steps:
            continue
        standby = s.get("standby") is True  # a warm standby: started before the kill
        before = [k for k in kills if k <= (run.steps[0]["t"] if standby else s["t_proc"])]
        if not before:
            continue
        kill = before[-1]
        j = journaled.get(s.get("pid"))
        if j is not None and not _one_failure(j, before[-2] if len(before) > 1 else t_spawn0):
            journaled.pop(s.get("pid"))  # it spans an earlier failure too
        restart.append(run.steps[0]["t"] - kill)
        if standby:  # no new process, imports or build: its restore() waited for the kill
            for p in ("process", "imports", "build"):
                parts[p].append(0.0)
            parts["restore"].append(s["t_restored"] - kill)
        else:
            parts["process"].append(s["t_proc"] - kill)
            parts["imports"].append(s["t_imported"] - s["t_proc"])
            parts["build"].append(s["t_restore"] - s["t_imported"])
            parts["restore"].append(s["t_restored"] - s["t_restore"])
        parts["first_step"].append(run.steps[0]["t"] - s["t_restored"])
    return restart, parts, cold


def _one_failure(event: Mapping[str, Any], previous_kill: float) -> bool:
    """The journaled kill instant (the killed run's last sign of life) follows the kill
    before: the journaled restart covers this failure only."""
    killed_t = event.get("killed_t")
    return not isinstance(killed_t, (int, float)) or killed_t >= previous_kill


def journaled_restarts(journal: Sequence[Mapping[str, Any]]) -> dict[Any, Mapping[str, Any]]:
    """The ``restart`` events of a flashckpt journal by the pid that journaled them."""
    out: dict[Any, Mapping[str, Any]] = {}
    for e in journal:
        secs = e.get("restart_seconds")
        if e.get("event") == "restart" and isinstance(secs, (int, float)) and secs >= 0:
            out.setdefault(e.get("pid"), e)
    return out


def _journal_parts(journaled: Mapping[Any, Mapping[str, Any]]) -> dict[str, float]:
    parts: dict[str, float] = {}
    for p in ("down", "start", "restore", "first_step"):
        vals = [e[f"{p}_s"] for e in journaled.values() if isinstance(e.get(f"{p}_s"), float)]
        if vals:
            parts[p] = statistics.fmean(vals)
    return parts


def analyze(
    records: Sequence[Mapping[str, Any]],
    *,
    kills: Sequence[float],
    t0: float,
    t_end: float,
    journal: Sequence[Mapping[str, Any]] | None = None,
    base_step_s: float | None = None,
) -> MethodResult:
    """``kills``: wall-clock times (``time.time()``) of the SIGKILLs inside ``[t0, t_end]``;
    ``t0``: when the first process was started; ``t_end``: when the run was stopped;
    ``journal``: the flashckpt method's journal events (its journaled restarts win);
    ``base_step_s``: the undisturbed step time (:func:`baseline_step_s`)."""
    runs = split_runs(records)
    pids = {r.start.get("pid") for r in runs[1:]}
    journaled = {pid: e for pid, e in journaled_restarts(journal or ()).items() if pid in pids}
    kept = surviving(runs)
    every = [r for run in runs for r in run.steps]
    step_s = base_step_s or (statistics.median(r["compute_s"] for r in every) if every else 0.0)
    wall = t_end - t0
    useful = len(kept) * step_s
    saves = [r for r in every if r.get("saved", r.get("blocked_s", 0) > 0)]
    blocking = sum(r["blocked_s"] for r in saves)
    # steps faster than the baseline (noise, a short run) can make the sum negative: no
    # measurable cost, not a negative one (Daly's model refuses negative costs)
    cost = max(0.0, _overhead_s(runs, step_s) / len(saves)) if saves else 0.0
    restart, parts, cold = _restarts(runs, kills, t0, journaled)
    saved_steps = sorted({r["step"] for r in saves})
    interval = _interval_s(saved_steps, step_s)
    mean = lambda xs: statistics.fmean(xs) if xs else 0.0  # noqa: E731
    lost_restart = max(0.0, mean(restart) - step_s)
    best = optimal_interval_s(cost, wall / len(kills)) if kills and wall > 0 else None
    return MethodResult(
        goodput=useful / wall if wall > 0 else 0.0,
        model_goodput=_daly(interval, cost, wall, len(kills), lost_restart),
        best_model_goodput=_daly(best, cost, wall, len(kills), lost_restart),
        wall_s=wall,
        useful_s=useful,
        failures=len(kills),
        steps_done=len(every),
        steps_lost=len(every) - len(kept),
        saves=len(saves),
        save_blocking_s=blocking,
        save_cost_s=cost,
        base_step_s=step_s,
        interval_s=interval,
        restore_s=[r.start["t_restored"] - r.start["t_restore"] for r in runs],
        restart_s=restart,
        journal_restart_s=[float(e["restart_seconds"]) for e in journaled.values()],
        restart_parts_s={k: mean(v) for k, v in parts.items()},
        restart_journaled=len(journaled),
        journal_restart_parts_s=_journal_parts(journaled),
        cold_start_s=cold,
        restart_ratio=(mean(restart) / cold) if restart and cold else None,
    )


def _overhead_s(runs: Sequence[Run], step_s: float) -> float:
    """Seconds the steps took beyond ``step_s`` (compute plus blocking), each process's first
    step left out (it belongs to the restart)."""
    return sum(r["compute_s"] + r["blocked_s"] - step_s for run in runs for r in run.steps[1:])


def baseline_step_s(records: Sequence[Mapping[str, Any]]) -> float | None:
    """The median step of a baseline log (no checkpointing), its first step left out."""
    steps = [r["compute_s"] for run in split_runs(records) for r in run.steps[1:]]
    return statistics.median(steps) if steps else None


def _interval_s(saved_steps: Sequence[int], step_s: float) -> float | None:
    """Mean seconds of work between saves (from the steps saved, in step units)."""
    gaps = [b - a for a, b in itertools.pairwise(saved_steps) if b > a]
    return statistics.fmean(gaps) * step_s if gaps and step_s > 0 else None


def _daly(
    interval: float | None, cost: float, wall: float, failures: int, restart: float
) -> float | None:
    if interval is None or interval <= 0 or failures == 0:
        return None
    waste = expected_waste_fraction(
        interval, cost_s=cost, mtbf_s=wall / failures, restart_s=restart
    )
    return 1.0 - waste
