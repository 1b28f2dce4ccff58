"""Restart with and without a warm standby: the median seconds from a SIGKILL to the first
resumed step, for ``flashckpt`` and ``flashckpt_standby`` (``flashckpt run --standby 1``).

    python benchmarks/standby_restart.py --kills 6 --every-s 20 [--small] [--threads 2]

Runs the chaos benchmark's trainer (the demo GPT, about 370 MB of model + AdamW state; --small:
a tiny one) for each method with the same kills, every --every-s seconds, no baseline runs, and
prints each method's median restart (the driver's kill -> the first resumed step), the
journal's median and mean parts (its kill is the killed run's last step, up to a step early)
and the ratio. A rough number
on a busy machine; the lead's chaos table (BENCHMARKS.md) is the measurement on a quiet one.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from flashckpt.demo.chaos import SMOKE_MODEL, run_chaos


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kills", type=int, default=6)
    ap.add_argument("--every-s", type=float, default=20.0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--out", default=None, help="also write the JSON result here")
    ap.add_argument("--dir", default=None, help="keep the runs here (default: a temporary one)")
    args = ap.parse_args()
    kills = [args.every_s * (k + 1) for k in range(args.kills)]
    with tempfile.TemporaryDirectory(prefix="standby-bench-") as d:
        res = run_chaos(
            out=Path(args.dir or d),
            minutes=(kills[-1] + args.every_s) / 60.0,
            mtbf_s=args.every_s,
            methods=["flashckpt", "flashckpt_standby"],
            model=SMOKE_MODEL if args.small else None,
            threads=args.threads,
            kills=kills,
            baseline_steps=0,
        )
    rows = {}
    for name, r in res["methods"].items():
        if "error" in r:
            print(f"{name}: failed: {r['error']}")
            continue
        med = statistics.median(r["restart_s"]) if r["restart_s"] else None
        jr = r.get("journal_restart_s") or []
        jmed = statistics.median(jr) if jr else None
        rows[name] = {"median_restart_s": med, "restarts": len(r["restart_s"]),
                      "restart_s": sorted(r["restart_s"]), "journal_median_s": jmed,
                      "journal_parts_s": r.get("journal_restart_parts_s"),
                      "goodput": r["goodput"]}  # fmt: skip
        parts = ", ".join(
            f"{k} {v:.2f}" for k, v in (r.get("journal_restart_parts_s") or {}).items()
        )
        if med is None:
            print(f"{name}: no restart completed a step (goodput {r['goodput']:.1%})")
            continue
        jtxt = f"journal median {jmed:.2f} s: " if jmed is not None else ""
        print(f"{name}: median restart {med:.2f} s over {len(r['restart_s'])} ({jtxt}{parts}); "
              f"goodput {r['goodput']:.1%}")  # fmt: skip
    a, b = rows.get("flashckpt"), rows.get("flashckpt_standby")
    if a and b and a["median_restart_s"] and b["median_restart_s"]:
        print(f"standby / cold: {b['median_restart_s'] / a['median_restart_s']:.2f}x")
    if args.out:
        Path(args.out).write_text(json.dumps({"rows": rows, "chaos": res}, indent=1))


if __name__ == "__main__":
    main()
