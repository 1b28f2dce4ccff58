"""Store barrier cost at 16 / 128 / 1024 simulated ranks, against a real TCPStore.

    python benchmarks/barrier_bench.py --ranks 16,128,1024 --phases 5 --out barrier_bench.json

Each simulated rank is a thread with its own TCPStore client connection to one TCPStore server
(as every process of a torchrun job talks to rank 0's store). All ranks run ``--phases``
consecutive phases of :class:`flashckpt.distributed.group.barrier.StoreBarrier` (the leader-based
protocol: post, ``add``, one blocking ``wait``, the leader's ``multi_get`` and ``compare_set``),
each started together from a thread barrier. Reported per world size: Store requests per rank per
phase (followers' mean and max, the leader's), requests per phase in total, and phase latency
(wall time from the start of a phase until the last rank returns; median over phases).

``--old`` also runs the protocol this replaced (every waiting rank polls every missing rank
with ``check``/``get`` and a 2-50 ms backoff), at the world sizes up to ``--old-max`` (its
O(world^2) requests make 1024 ranks take minutes). Prints a markdown table; writes JSON.
Threads share the GIL, so absolute latencies are those of one Python process driving every
rank (a real job has a process per rank); request counts do not depend on that.
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from collections.abc import Callable
from typing import Any

from torch.distributed import TCPStore

from flashckpt.distributed.group.barrier import StoreBarrier


class Counting:
    """A Store proxy that counts requests."""

    def __init__(self, store: Any) -> None:
        self.store, self.n = store, 0

    def __getattr__(self, name: str) -> Any:
        fn = getattr(self.store, name)

        def call(*args: Any) -> Any:
            self.n += 1
            return fn(*args)

        return call


def old_exchange(store: Any, rank: int, world: int, base: str, timeout_s: float) -> None:
    """The polling barrier before (flashckpt <= this change), for comparison."""
    store.set(f"{base}/{rank}", b'{"ok": true}')
    got: set[int] = set()
    deadline, pause = time.monotonic() + timeout_s, 0.002
    while True:
        for r in range(world):
            if r not in got and store.check([f"{base}/{r}"]):
                store.get(f"{base}/{r}")
                got.add(r)
        if len(got) == world:
            return
        if store.check([f"{base}/abort"]):
            raise RuntimeError("abort")
        if time.monotonic() > deadline:
            raise RuntimeError("timeout")
        time.sleep(pause)
        pause = min(pause * 2, 0.05)


def run(world: int, phases: int, port: int, protocol: str) -> dict[str, Any]:
    server = TCPStore("127.0.0.1", port, world + 1, True, wait_for_workers=False)
    clients = [Counting(TCPStore("127.0.0.1", server.port, is_master=False)) for _ in range(world)]
    start = threading.Barrier(world + 1)
    done = threading.Barrier(world + 1)
    counts: list[list[int]] = [[0] * phases for _ in range(world)]
    errors: list[BaseException] = []

    def rank_main(rank: int) -> None:
        store = clients[rank]
        barrier = StoreBarrier(
            store=store, rank=rank, world_size=world, timeout_s=120, prefix=f"b{world}"
        )
        for p in range(phases):
            start.wait()
            before = store.n
            try:
                if protocol == "new":
                    barrier.agree(f"p{p}", None)
                else:
                    old_exchange(store, rank, world, f"old{world}/p{p}", 300)
            except BaseException as exc:
                errors.append(exc)
            counts[rank][p] = store.n - before
            done.wait()

    threads = [threading.Thread(target=rank_main, args=(r,), daemon=True) for r in range(world)]
    for t in threads:
        t.start()
    latencies = []
    for _ in range(phases):
        start.wait()
        t0 = time.perf_counter()
        done.wait()
        latencies.append(time.perf_counter() - t0)
    for t in threads:
        t.join()
    if errors:
        raise RuntimeError(f"{len(errors)} rank(s) failed: {errors[0]}")
    followers = [c for r in range(1, world) for c in counts[r]]
    return {
        "protocol": protocol,
        "world": world,
        "phases": phases,
        "follower_mean": statistics.mean(followers),
        "follower_max": max(followers),
        "leader": max(counts[0]),
        "total_per_phase": sum(sum(c) for c in counts) / phases,
        "latency_s": statistics.median(latencies),
    }


def table(rows: list[dict[str, Any]]) -> str:
    out = [
        "| protocol | ranks | requests/rank/phase (followers: mean, max) | leader | "
        "requests/phase (all ranks) | phase latency (median) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    fmt: Callable[[float], str] = lambda s: f"{s * 1e3:.1f} ms"  # noqa: E731
    for r in rows:
        name = "leader-based (new)" if r["protocol"] == "new" else "polling (before)"
        out.append(
            f"| {name} | {r['world']} | {r['follower_mean']:.1f}, {r['follower_max']} | "
            f"{r['leader']} | {r['total_per_phase']:.0f} | {fmt(r['latency_s'])} |"
        )
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", default="16,128,1024")
    ap.add_argument("--phases", type=int, default=5)
    ap.add_argument("--old", action="store_true", help="also run the polling barrier it replaced")
    ap.add_argument("--old-max", type=int, default=128)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    rows = []
    for world in (int(w) for w in args.ranks.split(",")):
        phases = args.phases if world <= 128 else max(2, args.phases // 2)
        rows.append(run(world, phases, 0, "new"))
        if args.old and world <= args.old_max:
            rows.append(run(world, phases, 0, "old"))
        print(table(rows[-2:] if args.old and world <= args.old_max else rows[-1:]), flush=True)
    print()
    print(table(rows))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
