"""Distributed save/load: flashckpt vs torch.distributed.checkpoint on 1, 2 and 4 ranks.

    python benchmarks/dist_bench.py --size-mb 96 --ranks 1,2,4 --reps 3 --out dist_bench.json

The same total state (an FSDP2-sharded MLP + AdamW state, ``--size-mb`` in all) is saved and
loaded on each world size, gloo on CPU, every rank writing its shards to one shared directory.
Both libraries fsync (DCP's ``FileSystemWriter`` default; flashckpt ``fsync=True``) and save
synchronously; flashckpt saves are not incremental here (``incremental=False``) so both write
every byte. Load reads into the live sharded model and optimizer (flashckpt ``restore``; DCP
``load`` + ``set_state_dict``). Time per operation = slowest rank between two barriers; the
median of ``--reps`` is reported. Loads read files just written, i.e. mostly from page cache,
for both libraries alike. Prints a markdown table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import statistics
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist


def build(world: int, size_mb: float) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    width = 1024
    layers = max(1, round(size_mb * 2**20 / 3 / 4 / (width * width)))  # params + 2 Adam moments
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, width)).sum().backward()
    opt.step()
    return model, opt


def timed(fn: Any) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - t0


def rank_main(rank: int, world: int, init: str, workdir: str, args: dict[str, Any]) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    import flashckpt

    model, opt = build(world, args["size_mb"])
    state = {"model": model, "optim": opt}
    times: dict[str, list[float]] = {k: [] for k in ("fc_save", "fc_load", "dcp_save", "dcp_load")}
    root = Path(workdir)
    ckpt = flashckpt.Checkpointer(root / "flashckpt", incremental=False, fsync=True)
    for rep in range(args["reps"]):
        times["fc_save"].append(timed(lambda rep=rep: ckpt.save(rep, state)))
        times["fc_load"].append(timed(lambda rep=rep: ckpt.restore(state, step=rep)))
        path = root / f"dcp-{rep}"

        def dcp_save(path: Path = path) -> None:
            msd, osd = get_state_dict(model, opt)
            dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)

        def dcp_load(path: Path = path) -> None:
            msd, osd = get_state_dict(model, opt)
            sd = {"model": msd, "optim": osd}
            dcp.load(sd, checkpoint_id=path)
            set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])

        times["dcp_save"].append(timed(dcp_save))
        times["dcp_load"].append(timed(dcp_load))
    ckpt.close()
    nbytes = ckpt.store.load_manifest(0).total_bytes
    if rank == 0:
        out = {k: statistics.median(v) for k, v in times.items()}
        out.update(ranks=world, state_bytes=nbytes, raw=times)
        Path(workdir, "result.json").write_text(json.dumps(out))
    dist.destroy_process_group()


def run_world(world: int, args: dict[str, Any], base: Path) -> dict[str, Any]:
    workdir = base / f"ranks{world}"
    workdir.mkdir(parents=True)
    init = f"file://{base}/store-{uuid.uuid4().hex}"
    ctx = mp.get_context("spawn")
    procs = [
        ctx.Process(target=rank_main, args=(r, world, init, str(workdir), args))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(600)
        if p.exitcode != 0:
            raise SystemExit(f"a rank of the {world}-rank run failed (exit {p.exitcode})")
    result: dict[str, Any] = json.loads((workdir / "result.json").read_text())
    return result


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| ranks | state | flashckpt save | DCP save | flashckpt load | DCP load |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        mib = r["state_bytes"] / 2**20
        lines.append(
            f"| {r['ranks']} | {mib:.0f} MiB | {r['fc_save']:.3f} s | {r['dcp_save']:.3f} s "
            f"| {r['fc_load']:.3f} s | {r['dcp_load']:.3f} s |"
        )
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size-mb", type=float, default=96.0, help="total state (params + AdamW)")
    p.add_argument("--ranks", default="1,2,4")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    p.add_argument("--out", default="dist_bench.json")
    a = p.parse_args()
    args = {"size_mb": a.size_mb, "reps": a.reps}
    rows = []
    with tempfile.TemporaryDirectory(dir=a.dir, prefix="flashckpt-dist-bench-") as tmp:
        for world in (int(x) for x in a.ranks.split(",")):
            rows.append(run_world(world, args, Path(tmp)))
            print(f"{world} rank(s) done", flush=True)
    print(table(rows))
    machine = f"{platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}"
    Path(a.out).write_text(json.dumps({"machine": machine, "args": args, "rows": rows}, indent=1))
    print(f"machine: {machine}; JSON: {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
