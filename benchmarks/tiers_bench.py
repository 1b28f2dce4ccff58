"""Tiers benchmark: restore time of one checkpoint from memory (/dev/shm) vs local disk vs remote
(S3 API on a local moto server), and time from ``save()`` to durable in each tier.

    python benchmarks/tiers_bench.py --size 256MiB --repeat 3 [--json out.json]

Local restores run after evicting the chunk files from the page cache (posix_fadvise DONTNEED),
so they read the disk. The remote is moto's S3 server in this process on 127.0.0.1 (Python,
single machine): it measures the code path and the protocol overhead, not a real S3 network.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import socket
import statistics
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import torch

import flashckpt
from flashckpt.journal import read_events
from flashckpt.units import format_bytes, parse_bytes


def _moto() -> tuple[Any, str]:
    from moto.server import ThreadedMotoServer

    for k, v in {
        "AWS_ACCESS_KEY_ID": "bench",
        "AWS_SECRET_ACCESS_KEY": "bench",
        "AWS_DEFAULT_REGION": "us-east-1",
    }.items():
        os.environ.setdefault(k, v)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    url = f"http://127.0.0.1:{port}"
    os.environ["AWS_ENDPOINT_URL"] = url
    import boto3

    boto3.client("s3", endpoint_url=url).create_bucket(Bucket="flashckpt-bench")
    return server, url


def _state(nbytes: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    n = max(1, nbytes // (4 << 20))
    return {f"w{i}": torch.randn(1 << 20, generator=g) for i in range(n)}


def _evict(root: Path) -> None:
    for p in root.rglob("*"):
        if p.is_file():
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _restore_s(root: Path, *, repeat: int, evict: Path | None = None, **tiers: Any) -> float:
    times = []
    for _ in range(repeat):
        if evict is not None:
            _evict(evict)
        target = {k: torch.empty(1 << 20) for k in _state_keys}
        with flashckpt.Checkpointer(root, keep_memory_after_close=True, **tiers) as ck:
            t0 = time.perf_counter()
            step = ck.restore({"s": target})
            times.append(time.perf_counter() - t0)
            if step != 1:
                raise SystemExit(f"expected step 1, restored {step}")
    return statistics.median(times)


_state_keys: list[str] = []


def run(size: int, repeat: int, base: Path, shm: Path) -> dict[str, Any]:
    server, endpoint = _moto()
    try:
        state = _state(size)
        _state_keys[:] = list(state)
        nbytes = sum(t.numel() * 4 for t in state.values())
        root, url = base / "ck", f"s3://flashckpt-bench/{uuid.uuid4().hex[:8]}"
        with flashckpt.Checkpointer(
            root, memory_tier=shm, remote=url, keep_memory_after_close=True
        ) as ck:
            ck.save(1, {"s": state})
            if not ck.wait_promoted():
                raise SystemExit("promotion did not finish")
        ev = read_events(root)
        start = next(e["t"] for e in ev if e["event"] == "save_start")
        durable = {"memory": next(e["t"] for e in ev if e["event"] == "durable") - start}
        for e in ev:
            if e["event"] == "promoted":
                durable[e["dst"]] = e["t"] - start
        restore = {
            "memory": _restore_s(root, repeat=repeat, memory_tier=shm),
            "local": _restore_s(root, repeat=repeat, evict=root),
            "remote": _restore_s(base / "empty", repeat=repeat, remote=url),
        }
        return {
            "bytes": nbytes,
            "save_to_durable_s": durable,
            "restore_s": restore,
            "machine": f"{platform.node()} · {platform.processor() or platform.machine()} · "
            f"{os.cpu_count()} CPUs · torch {torch.__version__}",
            "remote": f"moto S3 server on {endpoint}",
        }
    finally:
        server.stop()


def table(res: dict[str, Any]) -> str:
    gb = res["bytes"] / 1e9
    lines = [
        f"State: {format_bytes(res['bytes'])} (float32, 4 MiB tensors), one checkpoint.",
        "",
        "| tier | save() -> durable | restore | restore GB/s |",
        "|---|---|---|---|",
    ]
    for t in ("memory", "local", "remote"):
        d, r = res["save_to_durable_s"].get(t), res["restore_s"][t]
        lines.append(
            f"| {t} | {d:.2f} s | {r:.2f} s | {gb / r:.2f} |"
            if d is not None
            else f"| {t} | - | {r:.2f} s | {gb / r:.2f} |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", default="256MiB")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dir", default=None, help="local tier parent (default: a temp dir)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    base = Path(args.dir or tempfile.mkdtemp(prefix="flashckpt-tiers-"))
    shm = Path("/dev/shm") / f"flashckpt-bench-{uuid.uuid4().hex[:8]}"
    try:
        res = run(parse_bytes(args.size), args.repeat, base, shm)
    finally:
        shutil.rmtree(shm, ignore_errors=True)
        if args.dir is None:
            shutil.rmtree(base, ignore_errors=True)
    print(table(res))
    print(f"\nmachine: {res['machine']}; remote: {res['remote']}")
    print(json.dumps(res, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
