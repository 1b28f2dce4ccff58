"""Where a save's cost goes in loop-cost's dispatch loop, save by save.

    python benchmarks/save_breakdown.py [--memory-tier] [--steps 300] [--every 10]

One process, flashckpt only: the 256 MiB state of 96 tensors of ``loop_cost.py`` trained with
its dispatch loop (one thread, many small ops), saved every ``--every`` steps. For each save
after the first three: how the governor ran it (background or its foreground probe), what
``save()`` itself took, the blocking time (``save()`` plus the optimizer hook's wait for
staging), the staging time, the time to durable, and the extra time of the ``--every`` steps
from the save on against the median step before the first save. Then the means over the
background saves.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

import flashckpt
from flashckpt.cli.bench import cost


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--memory-tier", action="store_true", help="a memory tier in /dev/shm")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--every", type=int, default=10)
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    model, opt = cost._state(256 << 20, 96)
    work = cost._work("dispatch")
    root = Path(tempfile.mkdtemp(prefix="fc-breakdown-"))
    mem = Path("/dev/shm") / f"{root.name}-memory" if a.memory_tier else None
    saves, steps = [], []
    try:
        with flashckpt.Checkpointer(root, async_save=True, keep=2, memory_tier=mem) as ck:
            for _ in range(3):
                work()
                opt.step()
            for step in range(1, a.steps + 1):
                t0 = time.perf_counter()
                work()
                opt.step()
                if step % a.every == 0 and 2 * a.every <= step <= a.steps - a.every:
                    t1 = time.perf_counter()
                    handle = ck.save(step, {"model": model, "optim": opt})
                    saves.append((step, time.perf_counter() - t1, handle))
                steps.append(time.perf_counter() - t0)
        events = [json.loads(line) for line in (root / "journal.jsonl").read_text().splitlines()]
    finally:
        shutil.rmtree(root, ignore_errors=True)
        if mem is not None:
            shutil.rmtree(mem, ignore_errors=True)
    ran = {e["step"]: e.get("ran") for e in events if e.get("event") == "governor"}
    base = statistics.median(steps[: 2 * a.every - 1])
    ms = lambda x: round(x * 1e3, 1)  # noqa: E731
    rows = []
    for step, call, h in saves[3:]:
        window = sum(steps[step - 1 : step - 1 + a.every]) - a.every * base
        s = h.stats
        rows.append(
            {"step": step, "ran": ran.get(step), "save_call_ms": ms(call),
             "blocking_ms": ms(s.blocking_s), "staged_ms": ms(s.staged_s),
             "durable_ms": ms(s.background_s), "window_ms": ms(window)}
        )  # fmt: skip
        print(rows[-1])
    bg = [r for r in rows if r["ran"] == "background"]
    if bg:
        keys = ("window_ms", "blocking_ms", "staged_ms", "durable_ms")
        means = {k: round(statistics.mean(r[k] for r in bg), 1) for k in keys}
        print(f"median step {ms(base)} ms; {len(bg)} background saves, means: {means}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
