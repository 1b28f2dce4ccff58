"""``flashckpt chaos``: goodput under real SIGKILL failures, flashckpt vs the peers."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from flashckpt.cli import argtypes
from flashckpt.cli.argtypes import integer
from flashckpt.demo.chaos import METHODS, SMOKE_MODEL, run_chaos


def register(sub: Any) -> None:
    p = sub.add_parser(
        "chaos",
        help="train while killing the process at random; goodput of flashckpt vs the peers",
        description="Trains the demo GPT (about 370 MB of state) with each method for --minutes "
        "of wall time, SIGKILLing it at exponentially distributed instants (mean --mtbf-s, the "
        "same instants for every method) and restarting it; prints goodput, lost steps, save "
        "blocking, restore and restart seconds, and Daly's model at the measured costs.",
    )
    p.add_argument(
        "--minutes", type=argtypes.minutes, default=30.0, help="wall time per method (default 30)"
    )
    p.add_argument(
        "--mtbf-s",
        type=argtypes.mtbf_s,
        default=300.0,
        help="mean seconds between failures (>= 1)",
    )
    p.add_argument("--methods", default=",".join(METHODS), help="comma-separated methods")
    p.add_argument("--seed", type=argtypes.seed, default=0, help="seed of the failure times")
    p.add_argument("--dir", default="runs/chaos", help="working directory (default runs/chaos)")
    p.add_argument("--out", default=None, help="also write the JSON result here")
    p.add_argument(
        "--threads", type=argtypes.count, default=None, help="torch threads of the trainer"
    )
    p.add_argument("--small", action="store_true", help="a tiny model (smoke test)")
    p.add_argument(
        "--promote-every",
        type=argtypes.count,
        default=1,
        help="flashckpt copies every K-th memory-tier checkpoint to disk (default 1: all)",
    )
    p.add_argument(
        "--segments",
        type=integer(low=1, high=1000, what="a number of rounds"),
        default=1,
        help="interleave the methods in K rounds of minutes/K each (fair against host drift)",
    )
    p.add_argument(
        "--load",
        type=integer(low=0, high=256, what="a number of processes"),
        default=0,
        help="N busy processes beside the trainer, whole run",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    common: dict[str, Any] = dict(
        out=Path(args.dir),
        minutes=args.minutes,
        mtbf_s=args.mtbf_s,
        methods=[m.strip() for m in args.methods.split(",") if m.strip()],
        seed=args.seed,
        model=SMOKE_MODEL if args.small else None,
        threads=args.threads,
        promote_every=args.promote_every,
    )
    if args.segments != 1 or args.load != 0:  # interleaved rounds (demo/chaos_rounds.py)
        from flashckpt.demo.chaos_rounds import rounds_table, run_rounds

        result = run_rounds(segments=args.segments, load=args.load, **common)
        text = rounds_table(result)
    else:
        result = run_chaos(**common)
        text = table(result)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    print(text)
    return 0


def table(result: dict[str, Any]) -> str:
    head = (
        "| method | goodput | Daly model | Daly at its optimum | failures | steps lost | "
        "cost/save | restore | restart (kill→step) | restart / cold start |"
    )
    rows = [head, "|" + "---|" * 10]
    pct = lambda x: "-" if x is None else f"{x:.1%}"  # noqa: E731
    for name, r in result["methods"].items():
        if "error" in r:
            rows.append(f"| {name} | failed: {r['error']} |" + " |" * 8)
            continue
        model = f"{pct(r['model_goodput'])} | {pct(r.get('best_model_goodput'))}"
        restore = max(r["restore_s"]) if r["restore_s"] else 0.0
        restart = sum(r["restart_s"]) / len(r["restart_s"]) if r["restart_s"] else None
        ratio = f"{r['restart_ratio']:.2f}x" if r["restart_ratio"] else "-"
        rows.append(
            f"| {name} | {r['goodput']:.1%} | {model} | {r['failures']} | {r['steps_lost']} | "
            f"{r['save_cost_s'] * 1e3:.0f} ms | {restore:.2f} s | "
            f"{'-' if restart is None else f'{restart:.2f} s'} | {ratio} |"
        )
    base = result.get("baseline")
    if base:
        around = ", ".join(f"{b:.3f}" for b in result.get("baselines_s", [base["step_s"]]))
        rows.append(
            f"\nuseful time per step: the mean of the baselines (no checkpointing) just before "
            f"and after each method: {around} s; cold start {base['cold_start_s']:.2f} s"
        )
    return "\n".join(rows)
