"""The report's charts and their captions, one function per figure (SVG strings)."""

from __future__ import annotations

from collections.abc import Sequence

from flashckpt.report.summary import Event, RunSummary, SaveRecord, num
from flashckpt.report.svg import (
    PALETTE,
    Marker,
    Series,
    bar_chart,
    empty_chart,
    fmt_bytes,
    fmt_num,
    fmt_rate,
    fmt_s,
    time_chart,
)

MAX_BARS = 300  # per-save charts show the newest saves only


INCIDENTS = {
    "crash_detected": ("crash", "#ef4444"),
    "save_failed": ("save failed", "#f59e0b"),
    "corrupt": ("corrupt", "#8b5cf6"),
    "steps_lost": ("steps lost", "#db2777"),
    "restore": ("restore", "#10b981"),
    "restart": ("restart", "#0ea5e9"),
    "scrub_damage": ("scrub damage", "#b45309"),  # every rank's (report/tierhealth.py)
    "abandoned_copy": ("abandoned copy", "#64748b"),
}


def opt(v: float | None, fmt: object = fmt_s) -> str:
    return "–" if v is None else fmt(v)  # type: ignore[operator]


def cap_save(s: RunSummary) -> str:
    return (
        f"Training blocked {opt(s.mean_blocking_s)} per save on average (max "
        f"{opt(s.max_blocking_s)}); durable in the slowest tier after {opt(s.mean_durable_s)}."
    )


def cap_bytes(s: RunSummary) -> str:
    total = s.bytes_new + s.bytes_reused
    share = f" ({s.bytes_reused / total:.0%} reused)" if total else ""
    return f"{fmt_bytes(s.bytes_new)} written, {fmt_bytes(s.bytes_reused)} reused{share}."


def cap_memory(evs: Sequence[Event]) -> str:
    mem = [e for e in evs if e.get("event") == "memory"]
    if not mem:
        return "No memory records in the journal."
    peak = max(num(e.get("max_allocated_bytes")) or num(e.get("allocated_bytes")) or 0 for e in mem)
    frag = max(num(e.get("fragmentation_bytes")) or 0 for e in mem)
    return f"Peak allocated {fmt_bytes(peak)}; largest fragmentation {fmt_bytes(frag)}."


def cap_interval(s: RunSummary) -> str:
    if s.interval_s is None:
        return "No interval decision journaled (fixed policies journal theirs once)."
    mtbf = f"; observed MTBF {fmt_s(s.observed_mtbf_s)}" if s.observed_mtbf_s else ""
    return f"Latest: {fmt_s(s.interval_s)} — {s.interval_reason}{mtbf}."


def cap_failures(s: RunSummary) -> str:
    return (
        f"{s.crashes} crash(es), {s.saves_failed} failed save(s), {s.corrupt} corrupt "
        f"checkpoint(s); {s.steps_lost} steps redone ({fmt_s(s.lost_s)}), restart gaps "
        f"{fmt_s(s.restart_gap_s)}." + _cap_tiers(s)
    )


def _cap_tiers(s: RunSummary) -> str:
    """The tiers' health (report/tierhealth.py), when the journal says anything about it."""
    if not (s.scrub_damage or s.abandoned_copies or s.scrubbed_bytes):
        return ""
    return (
        f" The idle scrub found {s.scrub_damage} damaged chunk(s) "
        f"({fmt_bytes(s.scrubbed_bytes)} verified); {s.abandoned_copies} checkpoint copies on "
        "an abandoned branch were skipped."
    )


def _shown(recs: Sequence[SaveRecord]) -> tuple[list[SaveRecord], list[str]]:
    shown = [r for r in recs if r.failed is None][-MAX_BARS:]
    return shown, [str(r.step) if r.step is not None else "?" for r in shown]


def save_times(recs: Sequence[SaveRecord]) -> str:
    shown, cats = _shown(recs)
    return bar_chart(
        title="blocking and durable seconds per save",
        categories=cats,
        series=[
            Series(label="blocking", ys=[r.blocking_s for r in shown], color=PALETTE[0]),
            Series(
                label="time to durable (slowest tier)",
                ys=[r.durable_s for r in shown],
                kind="line",
                color=PALETTE[1],
            ),
        ],
        y_label="seconds",
        y_fmt=fmt_s,
    )


def throughput(recs: Sequence[SaveRecord], s: RunSummary) -> str:
    shown, cats = _shown(recs)
    series = [
        Series(
            label="checkpoint throughput", ys=[r.throughput_Bps for r in shown], color=PALETTE[2]
        )
    ]
    if s.raw_Bps is not None:
        series.append(
            Series(
                label="raw device",
                ys=[s.raw_Bps] * len(shown),
                kind="line",
                color="#64748b",
                dash=True,
            )
        )
    return bar_chart(
        title="throughput per save",
        categories=cats,
        series=series,
        y_label="bytes/s",
        y_fmt=fmt_rate,
    )


def raw_note(s: RunSummary) -> str:
    if s.raw_Bps is None:
        return "No raw device bandwidth in the journal (a bench event with raw_Bps adds it)."
    if s.mean_throughput_Bps:
        return (
            f"Mean {fmt_rate(s.mean_throughput_Bps)} = {s.mean_throughput_Bps / s.raw_Bps:.0%}"
            f" of the raw device ({fmt_rate(s.raw_Bps)})."
        )
    return f"Raw device: {fmt_rate(s.raw_Bps)}."


def bytes_chart(recs: Sequence[SaveRecord]) -> str:
    shown, cats = _shown(recs)
    return bar_chart(
        title="bytes written vs reused per save",
        categories=cats,
        series=[
            Series(label="new", ys=[r.new_bytes for r in shown], color=PALETTE[0]),
            Series(label="reused", ys=[r.reused_bytes for r in shown], color="#cbd5e1"),
        ],
        y_label="bytes",
        y_fmt=fmt_bytes,
        stacked=True,
    )


def memory(evs: Sequence[Event], t0: float, t_end: float | None = None) -> str:
    mem = [e for e in evs if e.get("event") == "memory"]
    phases: dict[str, list[Event]] = {}
    for e in mem:
        phases.setdefault(str(e.get("phase", "?")), []).append(e)
    xs = [float(e["t"]) - t0 for e in mem]
    series = [
        Series(
            label="reserved",
            xs=xs,
            ys=[num(e.get("reserved_bytes")) for e in mem],
            kind="line",
            color="#94a3b8",
            dash=True,
        )
    ]
    for i, (phase, es) in enumerate(list(phases.items())[:8]):
        series.append(
            Series(
                label=f"allocated · {phase}",
                xs=[float(e["t"]) - t0 for e in es],
                ys=[num(e.get("allocated_bytes")) for e in es],
                kind="points",
                color=PALETTE[i % len(PALETTE)],
                notes=[
                    f"{phase}: {fmt_bytes(num(e.get('allocated_bytes')) or 0)} allocated, "
                    f"{fmt_bytes(num(e.get('fragmentation_bytes')) or 0)} fragmented"
                    for e in es
                ],
            )
        )
    return time_chart(
        title="GPU memory by phase", series=series, y_label="bytes", y_fmt=fmt_bytes, x_end=t_end
    )


def intervals(evs: Sequence[Event], t0: float, t_end: float | None = None) -> str:
    dec = [e for e in evs if e.get("event") == "interval" and num(e.get("interval_s")) is not None]
    xs = [float(e["t"]) - t0 for e in dec]
    notes = [
        f"{e.get('policy', '?')}: {fmt_s(num(e.get('interval_s')) or 0)}"
        f" ({e.get('interval_steps', '?')} steps), C={opt(num(e.get('cost_s')))},"
        f" MTBF={opt(num(e.get('mtbf_s')))} · {e.get('reason', '')}"
        for e in dec
    ]
    series = [
        Series(
            label="chosen interval",
            xs=xs,
            ys=[num(e.get("interval_s")) for e in dec],
            kind="step",
            color=PALETTE[4],
            notes=notes,
        )
    ]
    if any(num(e.get("persist_s")) is not None for e in dec):
        series.append(
            Series(
                label="persist floor",
                xs=xs,
                ys=[num(e.get("persist_s")) for e in dec],
                kind="step",
                color="#94a3b8",
                dash=True,
            )
        )
    return time_chart(
        title="interval decisions", series=series, y_label="interval", y_fmt=fmt_s, x_end=t_end
    )


def failures(evs: Sequence[Event], t0: float, t_end: float | None = None) -> str:
    markers = [
        Marker(
            x=float(e["t"]) - t0,
            label=describe(e),
            color=INCIDENTS[str(e["event"])][1],
            tag=INCIDENTS[str(e["event"])][0],
        )
        for e in evs
        if e.get("event") in INCIDENTS and e.get("event") != "steps_lost"
    ]
    lost = [e for e in evs if e.get("event") == "steps_lost"]
    series = [
        Series(
            label="steps lost",
            xs=[float(e["t"]) - t0 for e in lost],
            ys=[num(e.get("steps")) for e in lost],
            kind="points",
            color="#db2777",
            notes=[describe(e) for e in lost],
        )
    ]
    if not markers and not lost:
        return empty_chart("failures", "no failures recorded")
    return time_chart(
        title="failures and lost work",
        series=series,
        y_label="steps lost",
        y_fmt=fmt_num,
        markers=markers[-200:],
        x_end=t_end,
    )


def describe(e: Event) -> str:
    skip = {"t", "event", "pid", "rank"}
    fields = ", ".join(f"{k}={e[k]}" for k in e if k not in skip)
    return f"{e.get('event')}: {fields}"
