"""The terminal summary of a run (``flashckpt status``, the demo's last step)."""

from __future__ import annotations

from typing import Any

from flashckpt.report.restarts import describe_parts, describe_takeovers
from flashckpt.report.summary import RunSummary
from flashckpt.report.svg import fmt_bytes, fmt_rate, fmt_s


def _opt(value: float | None, fmt: Any = fmt_s) -> str:
    return "–" if value is None else str(fmt(value))


def _restart(s: RunSummary) -> str:
    """Kill -> first resumed step: last (its parts), mean, max."""
    if not s.restarts_timed:
        return "– (no restart after a crash timed yet)"
    parts = describe_parts(s.restart_parts_last, fmt_s, takeover=s.last_restart_takeover)
    warm = describe_takeovers(
        count=s.restarts_timed,
        takeovers=s.takeovers,
        takeover_mean_s=s.mean_takeover_s,
        cold_mean_s=s.mean_cold_restart_s,
        fmt=fmt_s,
    )
    return (
        f"last {_opt(s.last_restart_s)} ({parts}) · mean {_opt(s.mean_restart_s)}, max "
        f"{_opt(s.max_restart_s)} over {s.restarts_timed}" + (f"; {warm}" if warm else "")
    )


def format_status(s: RunSummary, *, root: str = "") -> str:
    """The terminal summary (one fact per line)."""
    if s.events == 0:
        return f"{root}: no journal events yet"
    total = s.bytes_new + s.bytes_reused
    reuse = f" ({s.bytes_reused / total:.0%} reused)" if total else ""
    raw = ""
    if s.raw_Bps and s.mean_throughput_Bps:
        raw = f" ({s.mean_throughput_Bps / s.raw_Bps:.0%} of raw {fmt_rate(s.raw_Bps)})"
    goodput = "–" if s.goodput is None else f"{s.goodput:.1%}"
    cost = "" if s.cost is None else f" · cost {s.cost:,.2f} ({s.wasted_cost or 0:,.2f} wasted)"
    mtbf = f" · observed MTBF {fmt_s(s.observed_mtbf_s)}" if s.observed_mtbf_s else ""
    lines = [
        f"{root}",
        f"  runs      {s.runs} · last step {_opt(s.last_step, str)} · last durable step "
        f"{_opt(s.last_durable_step, str)} · wall {fmt_s(s.wall_s)}",
        f"  saves     {s.saves} ({s.saves_failed} failed, {s.saves_skipped} skipped) · blocking "
        f"mean {_opt(s.mean_blocking_s)}, max {_opt(s.max_blocking_s)} · durable mean "
        f"{_opt(s.mean_durable_s)}",
        f"  bytes     {fmt_bytes(s.bytes_new)} new, {fmt_bytes(s.bytes_reused)} reused{reuse} · "
        f"throughput {_opt(s.mean_throughput_Bps, fmt_rate)}{raw}",
        f"  failures  {s.crashes} crash(es), {s.corrupt} corrupt · {s.steps_lost} steps lost "
        f"({fmt_s(s.lost_s)}) · {s.restores} restore(s) ({fmt_s(s.restore_s)}) · restart gaps "
        f"{fmt_s(s.restart_gap_s)}",
        f"  tiers     {s.scrub_damage} damaged chunk(s) found by the scrub "
        f"({fmt_bytes(s.scrubbed_bytes)} verified) · {s.abandoned_copies} abandoned "
        "checkpoint cop" + ("y" if s.abandoned_copies == 1 else "ies") + " skipped",
        f"  restart   {_restart(s)}",
        f"  interval  {_opt(s.interval_s)} ({s.interval_reason or 'no decision journaled'}){mtbf}",
        f"  governor  {_governor(s)}",
        f"  goodput   {goodput}{cost}",
    ]
    return "\n".join(lines)


def _governor(s: RunSummary) -> str:
    """The governor's latest decision: how the next save runs, and the costs it compared."""
    if s.governor_mode is None:
        return "no decision journaled (synchronous saves, or none settled yet)"
    return (
        f"next save {s.governor_mode} ({s.governor_reason}) · cost per save background "
        f"{_opt(s.governor_background_cost_s)}, foreground {_opt(s.governor_foreground_cost_s)}"
    )
