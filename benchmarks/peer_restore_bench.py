"""Peer restore benchmark: restore time of one checkpoint on a replacement node from its peer's
memory tier (gloo over loopback) vs from the local disk vs from the remote (S3 API on a local
moto server), two ranks on two simulated nodes (``Replication(placement=...)``).

    python benchmarks/peer_restore_bench.py --size 128MiB --repeat 3 [--json out.json]

Setup: the job (2 ranks, DDP-style state: every tensor identical on both ranks) saves step 1 to
the disk tier; node 0's memory tier then holds that checkpoint (its chunks and manifest, as a
node holding its own chunks plus its peer's replicas would), node 1's is empty (a replacement
node). Each restore is timed inside ``Checkpointer.restore`` on every rank; the table shows the
slower rank (node 1 fetches every byte it restores from node 0); ``peer: fetch part`` is the
part of it spent fetching (journal ``restored_from_peers.fetch_seconds``: plan, transfer, verify,
write into node 1's tier), the rest is the normal verified load. ``gloo raw`` is one send of the
same bytes between the two ranks, the transport's ceiling. Disk restores run after evicting the
chunk files from the page cache. The moto server runs in the benchmark process (Python): it
measures the code path and protocol overhead, not a real S3 network.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import shutil
import socket
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import torch
import torch.distributed.tensor  # imported once, before the ranks fork (1-10 s)

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from tiers_bench import _evict, _moto  # noqa: E402

import flashckpt  # noqa: E402
from flashckpt.engine.options import Replication  # noqa: E402
from flashckpt.units import format_bytes, parse_bytes  # noqa: E402

NODES = {0: "n0", 1: "n1"}


def _state(nbytes: int, seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    n = max(1, nbytes // (4 << 20))
    return {
        "model": torch.nn.ParameterDict(
            {f"w{i}": torch.nn.Parameter(torch.randn(1 << 20, generator=g)) for i in range(n)}
        )
    }


def _rank_main(rank: int, init: str, out: Path, cfg: dict[str, Any]) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    try:
        res = _scenario(rank, cfg)
    except BaseException as exc:  # reported, the benchmark stops
        res = {"error": f"{type(exc).__name__}: {exc}"}
    out.write_text(json.dumps(res))
    os._exit(0)


def _scenario(rank: int, cfg: dict[str, Any]) -> dict[str, Any]:
    import torch.distributed as dist

    kind, size = cfg["kind"], cfg["size"]
    if kind == "save":  # to the disk, promoted to the remote: the same checkpoint in both
        kw0 = {"fsync": True, "dist_timeout_s": 120, "remote": cfg.get("remote")}
        with flashckpt.Checkpointer(cfg["root"], **kw0) as ck:
            ck.save(1, _state(size, 0))
            if not ck.wait_promoted():
                raise SystemExit("promotion to the remote did not finish")
        return {}
    if kind == "raw":
        buf = torch.empty(size, dtype=torch.uint8)
        dist.barrier()
        t0 = time.perf_counter()
        (dist.send if rank == 0 else dist.recv)(buf, 1 - rank)
        dist.barrier()
        return {"s": time.perf_counter() - t0}
    kw: dict[str, Any] = {"fsync": False, "dist_timeout_s": 120}
    if kind == "peer":
        kw["memory_tier"] = cfg["tiers"][rank]
        kw["replicas"] = Replication(placement=lambda r: NODES[r], timeout_s=120)
    if kind == "remote":
        kw["remote"] = cfg["remote"]
    target = _state(size, 1)
    with flashckpt.Checkpointer(cfg["root"], **kw) as ck:
        dist.barrier()
        t0 = time.perf_counter()
        step = ck.restore(target)
        seconds = time.perf_counter() - t0
    if step != 1:
        raise SystemExit(f"{kind}: expected step 1, restored {step}")
    same = all(
        torch.equal(a, b)
        for a, b in zip(target["model"].values(), _state(size, 0)["model"].values())
    )
    if not same:
        raise SystemExit(f"{kind}: restored state differs from the saved one")
    from flashckpt.journal import read_events

    done = [
        e
        for e in read_events(cfg["root"])
        if e["event"] == "restored_from_peers" and e.get("rank") == rank
    ]
    if kind == "peer" and not done:
        raise SystemExit("peer: the restore did not come from the peers (no restored_from_peers)")
    return {"s": seconds, "fetch_s": done[-1]["fetch_seconds"] if done else 0.0}


def _ranks(cfg: dict[str, Any], tmp: Path) -> list[dict[str, Any]]:
    ctx = mp.get_context("fork")
    with socket.socket() as sock:  # a TCP store, as torchrun's (a FileStore polls slowly)
        sock.bind(("127.0.0.1", 0))
        init = f"tcp://127.0.0.1:{sock.getsockname()[1]}"
    outs = [tmp / f"out-{uuid.uuid4().hex}-{r}.json" for r in (0, 1)]
    procs = [ctx.Process(target=_rank_main, args=(r, init, outs[r], cfg)) for r in (0, 1)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(600)
    res = [json.loads(o.read_text()) if o.exists() else {"error": "died"} for o in outs]
    for r in res:
        if "error" in r:
            raise SystemExit(f"{cfg['kind']}: {r['error']}")
    return res


def _fill_node0(root: Path, tier: Path) -> None:
    """Node 0's memory tier holds the checkpoint (chunks + manifest); its tiers.json is new."""
    shutil.rmtree(tier, ignore_errors=True)
    tier.mkdir(mode=0o700, parents=True)
    shutil.copytree(root / "chunks", tier / "chunks")
    (tier / "steps").mkdir()
    shutil.copy(root / "steps" / "000000000001.json", tier / "steps")


def run(size: int, repeat: int, base: Path, shm: Path) -> dict[str, Any]:
    server, endpoint = _moto()
    try:
        root, url = base / "ck", f"s3://flashckpt-bench/{uuid.uuid4().hex[:8]}"
        _ranks({"kind": "save", "size": size, "root": str(root), "remote": url}, base)
        times: dict[str, list[float]] = {
            "peer": [],
            "peer: fetch part": [],
            "local": [],
            "remote": [],
            "gloo raw": [],
        }
        for i in range(repeat):
            n0, n1 = shm / "n0", shm / f"n1-{i}"
            _fill_node0(root, n0)
            peer = {"kind": "peer", "size": size, "root": str(root), "tiers": [str(n0), str(n1)]}
            got = _ranks(peer, base)
            times["peer"].append(max(r["s"] for r in got))
            times["peer: fetch part"].append(max(r["fetch_s"] for r in got))
            shutil.rmtree(n1, ignore_errors=True)
            _evict(root)
            times["local"].append(
                max(
                    r["s"] for r in _ranks({"kind": "local", "size": size, "root": str(root)}, base)
                )
            )
            remote = {
                "kind": "remote",
                "size": size,
                "root": str(base / f"empty-{i}"),
                "remote": url,
            }
            times["remote"].append(max(r["s"] for r in _ranks(remote, base)))
            raw = {"kind": "raw", "size": size}
            times["gloo raw"].append(max(r["s"] for r in _ranks(raw, base)))
        nbytes = sum(t.numel() * 4 for t in _state(size, 0)["model"].values())
        return {
            "bytes": nbytes,
            "restore_s": {k: statistics.median(v) for k, v in times.items()},
            "all_s": times,
            "machine": f"{platform.node()} · {platform.processor() or platform.machine()} · "
            f"{os.cpu_count()} CPUs · torch {torch.__version__} · load {os.getloadavg()[0]:.2f}",
            "remote": f"moto S3 server on {endpoint}",
        }
    finally:
        server.stop()


def table(res: dict[str, Any]) -> str:
    gb = res["bytes"] / 1e9
    lines = [
        f"State: {format_bytes(res['bytes'])} (float32, 4 MiB tensors, identical on 2 ranks), "
        "one checkpoint, restored by 2 ranks on 2 simulated nodes; node 1 is a replacement.",
        "",
        "| source | restore (slower rank) | GB/s |",
        "|---|---|---|",
    ]
    for k, s in res["restore_s"].items():
        lines.append(f"| {k} | {s:.2f} s | {gb / s:.3f} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", default="128MiB")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dir", default=None, help="local tier parent (default: a temp dir)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    base = Path(args.dir or tempfile.mkdtemp(prefix="flashckpt-peer-"))
    shm = Path("/dev/shm") / f"flashckpt-peerbench-{uuid.uuid4().hex[:8]}"
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
