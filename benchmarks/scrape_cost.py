"""What a Prometheus scrape of a long journal costs (issue 28: 300k events took 15 s).

    python benchmarks/scrape_cost.py [--events 300000] [--appends 5] [--lines 100]

Writes a journal of ``--events`` events (a training run: a ``step`` and a ``step_time`` tick
per step, a save every 10 steps), then times: reading it whole once (what the exporter does at
start, before it serves), and ``--appends`` scrapes (``PrometheusExporter.collect``) each after
``--lines`` new lines were appended. Wall and CPU (``process_time``) seconds; the floor is
``json.loads`` of every line once, timed in the same run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path


def _journal(path: Path, events: int) -> tuple[int, float]:
    t, step, lines = 1.7e9, 0, []
    while len(lines) < events:
        step += 1
        t += 0.1
        lines.append({"event": "step", "step": step, "t": t, "pid": 1, "rank": 0})
        lines.append(
            {"event": "step_time", "step": step, "seconds": 0.1, "t": t, "pid": 1, "rank": 0}
        )
        if step % 10 == 0:
            lines.append({"event": "save_start", "step": step, "t": t, "pid": 1, "rank": 0})
            lines.append(
                {"event": "staged", "step": step, "blocking_s": 0.01, "t": t, "pid": 1, "rank": 0}
            )
            lines.append(
                {
                    "event": "durable",
                    "step": step,
                    "tier": "local",
                    "new_bytes": 1e5,
                    "total_bytes": 1e6,
                    "background_s": 0.2,
                    "t": t + 0.2,
                    "pid": 1,
                    "rank": 0,
                }
            )
    path.write_text("".join(json.dumps(e) + "\n" for e in lines[:events]))
    return step, t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--events", type=int, default=300_000)
    ap.add_argument("--appends", type=int, default=5)
    ap.add_argument("--lines", type=int, default=100)
    args = ap.parse_args()
    from flashckpt.report.prometheus import PrometheusExporter

    root = Path(tempfile.mkdtemp(prefix="flashckpt-scrape-"))
    journal = root / "journal.jsonl"
    step, t = _journal(journal, args.events)
    w, c = time.perf_counter(), time.process_time()
    for line in journal.read_bytes().splitlines():
        json.loads(line)
    floor = (time.perf_counter() - w, time.process_time() - c)
    exp = PrometheusExporter(root, port=0)
    w, c = time.perf_counter(), time.process_time()
    exp.summary()  # what start() does before it serves
    first = (time.perf_counter() - w, time.process_time() - c)
    scrapes = []
    for k in range(args.appends):
        with open(journal, "a") as f:
            for j in range(args.lines):
                step += 1
                e = {"event": "step", "step": step, "t": t + k + j / 1e3, "pid": 1, "rank": 0}
                f.write(json.dumps(e) + "\n")
        w, c = time.perf_counter(), time.process_time()
        list(exp.collect())
        scrapes.append((time.perf_counter() - w, time.process_time() - c))
    med = (statistics.median(s[0] for s in scrapes), statistics.median(s[1] for s in scrapes))
    print(
        f"journal: {args.events} events; json.loads of every line once: "
        f"{floor[0]:.2f} s wall, {floor[1]:.2f} s CPU"
    )
    print(
        f"exporter start (reads the journal once): {first[0]:.2f} s wall, {first[1]:.2f} s CPU "
        f"({first[1] / floor[1]:.1f}x the floor's CPU)"
    )
    print(
        f"scrape after {args.lines} new lines (median of {args.appends}): "
        f"{med[0] * 1e3:.0f} ms wall, {med[1] * 1e3:.0f} ms CPU"
    )


if __name__ == "__main__":
    main()
