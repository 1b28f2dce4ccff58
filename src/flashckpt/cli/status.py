"""``flashckpt status ROOT``: the report's numbers as a short text summary for a terminal."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from flashckpt.errors import ConfigError
from flashckpt.report.summary import RunSummary, load_events, summarize
from flashckpt.report.svg import fmt_bytes, fmt_rate, fmt_s


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "status",
        help="summarize a run: saves, stalls, failures, interval, goodput, cost",
        description="Print the run journal of ROOT as a short summary.",
    )
    p.add_argument("root", metavar="ROOT", help="checkpoint root (holds journal.jsonl)")
    p.add_argument(
        "--gpu-hour-price", type=float, default=None, metavar="P", help="price per GPU hour"
    )
    p.add_argument("--gpus", type=int, default=None, help="GPUs billed (default: ranks seen)")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.set_defaults(func=run)


def _opt(value: float | None, fmt: Any = fmt_s) -> str:
    return "–" if value is None else str(fmt(value))


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
        f"  interval  {_opt(s.interval_s)} ({s.interval_reason or 'no decision journaled'}){mtbf}",
        f"  goodput   {goodput}{cost}",
    ]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    root = Path(args.root)
    if not root.exists():
        raise ConfigError(f"ROOT {root} does not exist; pass the checkpoint root of a run")
    s = summarize(load_events(root), gpu_hour_price=args.gpu_hour_price, gpus=args.gpus)
    print(json.dumps(s.as_dict(), indent=2) if args.json else format_status(s, root=str(root)))
    return 0
