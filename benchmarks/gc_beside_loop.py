"""Retention's garbage collection beside a dispatch-bound training thread.

    python benchmarks/gc_beside_loop.py [--memory-tier] [--chunks 49] [--rounds 6]

Saves ``--rounds + 1`` steps of ``--chunks`` 1 MiB tensors (one chunk each), then for each
round deletes the oldest step and collects its chunks on a background thread while the main
thread runs loop-cost's dispatch loop (one thread, small torch ops, each releasing the GIL).
Prints the collection's wall time there (median) and the loop's extra time against the same
loop alone. The wall time is the steady figure: every system call gc makes from Python waits
for the GIL to come back from the loop.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import threading
import time
from pathlib import Path

import torch

import flashckpt
from flashckpt.cli.bench import cost
from flashckpt.store.files.backend import LocalBackend
from flashckpt.store.gc import collect_garbage
from flashckpt.store.store import CheckpointStore


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--memory-tier", action="store_true", help="a root in /dev/shm (pooled)")
    p.add_argument("--chunks", type=int, default=49)
    p.add_argument("--rounds", type=int, default=6)
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    base = Path("/dev/shm") if a.memory_tier else Path(tempfile.gettempdir())
    root = Path(tempfile.mkdtemp(prefix="fc-gc-loop-", dir=base))
    try:
        with flashckpt.Checkpointer(root, keep=a.rounds + 2) as ck:
            for s in range(1, a.rounds + 2):
                ck.save(s, {f"t{i}": torch.full((1 << 18,), s * 1e3 + i) for i in range(a.chunks)})
        store = CheckpointStore(LocalBackend(root))
        if a.memory_tier:
            store.backend.recycle_bytes = 1 << 30  # as a memory tier's save path sets it
        collect_garbage(store)  # a process's first collection sweeps everything: not timed
        work = cost._work("dispatch")  # loop-cost's profile: 3000 small ops a call

        def loop(calls: int = 20) -> float:
            t = time.perf_counter()
            for _ in range(calls):
                work()
            return time.perf_counter() - t

        alone = statistics.median(loop() for _ in range(3))
        walls, costs = [], []
        for s in range(1, a.rounds + 1):
            store.delete_step(s)
            got: dict[str, float] = {}

            def collect(got: dict[str, float] = got) -> None:
                t = time.perf_counter()
                res = collect_garbage(store)
                got["wall"], got["chunks"] = time.perf_counter() - t, res.chunks_deleted

            th = threading.Thread(target=collect)
            th.start()
            costs.append(loop() - alone)
            th.join()
            if got["chunks"] != a.chunks:
                raise SystemExit(f"collected {got['chunks']} chunks, expected {a.chunks}")
            walls.append(got["wall"])
        print(
            f"{'memory tier' if a.memory_tier else 'disk'}: collecting {a.chunks} chunks beside "
            f"the loop: median {statistics.median(walls) * 1e3:.1f} ms; loop's extra time "
            f"median {statistics.median(costs) * 1e3:.1f} ms "
            f"({', '.join(f'{c * 1e3:.0f}' for c in costs)})"
        )
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
