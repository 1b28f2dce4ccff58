"""Peer replication benchmark: throughput per rank over loopback gloo vs raw gloo send/recv of the
same bytes, and the extra training-step time while a replication round runs.

    python benchmarks/replication_bench.py --size 64MiB --steps 60 --save-every 15

Two ranks on this machine stand for two nodes (``Replication(placement=...)``), each with its
own memory tier in /dev/shm, on gloo over 127.0.0.1.

Part 1: one save of ``--size`` bytes per rank (8 per-rank tensors), timed from the replicator's
chunk exchange (``RoundResult.transfer_s``: read, send, receive, verify, write), against
``isend``/``irecv`` of the same byte count in the same batches (half of ``inflight_bytes``)
on a fresh gloo group.

Part 2: a training loop (matmuls, ``--step-ms`` of work per step) saving asynchronously every
``--save-every`` steps; a step's time is compared between steps that ran while this rank's
replication round was in flight and steps that did not (same run, same process).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import statistics
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import torch

from flashckpt.units import format_bytes, parse_bytes


def _state(nbytes: int, rank: int, tensors: int = 8) -> dict[str, torch.Tensor]:
    """Per-rank tensors (different on every rank, so each rank's chunks are its own)."""
    n = max(1, nbytes // 4 // tensors)
    g = torch.Generator().manual_seed(rank)
    return {f"w{i}": torch.randn(n, generator=g) for i in range(tensors)}


def _open(root: Path, shm: Path, rank: int, **kw: Any) -> Any:
    from flashckpt import Checkpointer
    from flashckpt.engine.options import Replication

    rep = Replication(placement=lambda r: f"n{r}", timeout_s=300)
    return Checkpointer(
        root,
        memory_tier=shm / f"n{rank}",
        replicas=rep,
        fsync=False,
        dist_timeout_s=300,
        keep=1,
        **kw,
    )


def _raw_gloo(nbytes: int, batch: int, rank: int) -> float:
    """Seconds for the ring of isend/irecv of ``nbytes`` in ``batch``-byte messages."""
    import torch.distributed as dist

    group = dist.new_group(backend="gloo")
    peer = 1 - rank
    out = torch.ones(min(batch, nbytes), dtype=torch.uint8)
    inb = torch.empty_like(out)
    dist.barrier(group=group)
    t0 = time.perf_counter()
    left = nbytes
    while left > 0:
        k = min(batch, left)
        works = [
            dist.irecv(inb[:k], group=group, group_src=peer),
            dist.isend(out[:k], group=group, group_dst=peer),
        ]
        for w in works:
            w.wait()
        left -= k
    return time.perf_counter() - t0


def _throughput(rank: int, root: Path, shm: Path, nbytes: int) -> dict[str, Any]:
    state = _state(nbytes, rank)
    with _open(root, shm, rank) as ck:
        ck.save(1, state)
        ck._dist.replicator.drain()
        res = ck._dist.replicator.history[-1]
        batch = ck._dist.replication.inflight_bytes // 2  # the replicator's batches
    raw_s = _raw_gloo(res.sent_bytes, batch, rank)
    return {"sent": res.sent_bytes, "repl_s": res.transfer_s, "raw_s": raw_s}


def _loop(rank: int, root: Path, shm: Path, nbytes: int, a: argparse.Namespace) -> dict[str, Any]:
    state = _state(nbytes, rank)
    x = torch.randn(256, 256)
    w = torch.randn(256, 256)
    reps = max(1, int(a.step_ms / 2))  # ~2 ms per 256^3 matmul on one core; calibrated below
    busy: list[float] = []
    idle: list[float] = []
    with _open(root, shm, rank, async_save=True) as ck:
        rep = ck._dist.replicator
        for step in range(1, a.steps + 1):
            t0 = time.perf_counter()
            for _ in range(reps):
                x = torch.tanh(x @ w)
            with torch.no_grad():
                state["w0"].add_(1e-3)  # one tensor changes: each save sends one chunk
            dt = time.perf_counter() - t0
            (busy if rep.in_flight() else idle).append(dt)
            if step % a.save_every == 0:
                ck.save(step, state)
    return {"busy": busy, "idle": idle}


def _rank(rank: int, init: str, out: str, a: argparse.Namespace, tmp: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    nbytes = parse_bytes(a.size)
    t = Path(tmp)
    res = {
        "throughput": _throughput(rank, t / "root1", t / "shm1", nbytes),
        "loop": _loop(rank, t / "root2", t / "shm2", nbytes, a),
    }
    Path(out).write_text(json.dumps(res))
    os._exit(0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="64MiB", help="checkpoint bytes per rank")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--save-every", type=int, default=15)
    p.add_argument("--step-ms", type=float, default=20.0)
    p.add_argument("--json", default=None)
    a = p.parse_args()
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    tmp = base / f"flashckpt-replbench-{uuid.uuid4().hex[:8]}"
    tmp.mkdir(mode=0o700)
    try:
        init = f"file://{tmp}/store"
        outs = [str(tmp / f"rank{r}.json") for r in (0, 1)]
        ctx = mp.get_context("fork")
        procs = [ctx.Process(target=_rank, args=(r, init, outs[r], a, str(tmp))) for r in (0, 1)]
        for proc in procs:
            proc.start()
        for proc in procs:
            proc.join(900)
        results = [json.loads(Path(o).read_text()) for o in outs]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    _report(results, a)


def _report(results: list[dict[str, Any]], a: argparse.Namespace) -> None:
    print(f"size {a.size} per rank, 2 ranks = 2 simulated nodes, gloo over 127.0.0.1")
    print("| rank | bytes sent | replication | MB/s | raw gloo | MB/s | ratio |")
    print("|---|---|---|---|---|---|---|")
    for r, res in enumerate(results):
        t = res["throughput"]
        mbs = t["sent"] / t["repl_s"] / 1e6
        raw = t["sent"] / t["raw_s"] / 1e6
        print(
            f"| {r} | {format_bytes(t['sent'])} | {t['repl_s']:.3f} s | {mbs:.0f} | "
            f"{t['raw_s']:.3f} s | {raw:.0f} | {t['repl_s'] / t['raw_s']:.2f}x |"
        )
    print()
    print("| rank | steps idle | median step (idle) | steps replicating | median step | extra |")
    print("|---|---|---|---|---|---|")
    for r, res in enumerate(results):
        lp = res["loop"]
        idle = statistics.median(lp["idle"]) if lp["idle"] else float("nan")
        busy = statistics.median(lp["busy"]) if lp["busy"] else float("nan")
        print(
            f"| {r} | {len(lp['idle'])} | {idle * 1e3:.1f} ms | {len(lp['busy'])} | "
            f"{busy * 1e3:.1f} ms | {(busy / idle - 1) * 100:+.1f}% |"
        )
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
