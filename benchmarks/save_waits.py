"""How long the training thread waits, runnable, for a CPU because a save's threads run.

    python benchmarks/save_waits.py [--tier memory|disk] [--saves 12] [--state-mib 256]

The loop-cost benchmark's dispatch profile (one training thread issuing small ops, a 256 MiB
state of 96 tensors with SGD momentum) in one process: 20 steps without saves give the
thread's own run-queue wait per step, then each save (async, ``keep=2``, with a memory tier in
/dev/shm or on disk alone) is followed by 9 more steps, and the wait of those 10 steps beyond
10 quiet steps is what that save's threads took from training. Linux schedstat
(the same reading as ``engine/runtime/hostcpu.run_queue_wait_s``, kept here so that the script
also measures older trees): unlike step times, it does not move when the host runs every step
slower or faster. Prints the median of the saves after the first two.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import threading
from pathlib import Path


def run_queue_wait_s() -> float | None:
    """Seconds the calling thread has waited, runnable, for a CPU (None: not Linux)."""
    try:
        with open(f"/proc/self/task/{threading.get_native_id()}/schedstat", "rb") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, ValueError, IndexError):
        return None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tier", choices=("memory", "disk"), default="memory")
    p.add_argument("--saves", type=int, default=12)
    p.add_argument("--state-mib", type=int, default=256)
    a = p.parse_args(argv)

    import torch

    import flashckpt
    from flashckpt.cli.bench import cost

    if run_queue_wait_s() is None:
        raise SystemExit("save_waits: this kernel gives no per-thread schedstat (Linux only)")
    torch.set_num_threads(1)
    model, opt = cost._state(a.state_mib << 20, 96)
    work = cost._work("dispatch")
    root = Path(tempfile.mkdtemp(prefix="fc-waits-"))
    shm = Path("/dev/shm") if Path("/dev/shm").is_dir() else root
    mem = Path(tempfile.mkdtemp(prefix="fc-waits-mem-", dir=shm)) if a.tier == "memory" else None

    def steps(n: int) -> None:
        for _ in range(n):
            work()
            opt.step()

    try:
        ck = flashckpt.Checkpointer(root / "ck", async_save=True, keep=2, memory_tier=mem)
        steps(3)
        w0 = run_queue_wait_s() or 0.0
        steps(20)
        quiet = ((run_queue_wait_s() or 0.0) - w0) / 20
        per_save = []
        for s in range(a.saves):
            w0 = run_queue_wait_s() or 0.0
            steps(1)
            ck.save(s + 1, {"model": model, "optim": opt})
            steps(9)
            per_save.append((run_queue_wait_s() or 0.0) - w0 - 10 * quiet)
        ck.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)
        if mem is not None:
            shutil.rmtree(mem, ignore_errors=True)
    ms = [round(x * 1e3, 1) for x in per_save]
    print(f"{a.tier}: run-queue wait per save {statistics.median(per_save[2:]) * 1e3:.1f} ms {ms}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
