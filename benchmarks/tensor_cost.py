"""What one small tensor costs a save and a restore, side by side with torch.save / torch.load.

    python benchmarks/tensor_cost.py [--tensors 50000] [--numel 16] [--repeats 3] [--out x.json]

A state of ``--tensors`` float32 tensors of ``--numel`` elements each (the shape of a model with
many small parameters: norms, biases, LoRA adapters, per-parameter optimizer scalars). For each
method, in one process and the same run: a save to disk (fsynced) and a restore into existing
tensors; flashckpt synchronous and asynchronous (blocking time and time to durable), and a
restore from the memory tier. Each is timed ``--repeats`` times, wall and CPU (``process_time``:
less sensitive to a busy host than wall time); the table gives the median microseconds per
tensor and the ratio to torch.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


def _timed(fn: Callable[[], Any]) -> tuple[float, float]:
    w, c = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - w, time.process_time() - c


def run(*, tensors: int, numel: int, repeats: int, work: Path) -> dict[str, Any]:
    import torch

    import flashckpt

    g = torch.Generator().manual_seed(0)
    state = {f"layer{i // 4}.p{i % 4}": torch.randn(numel, generator=g) for i in range(tensors)}
    target = {k: torch.empty_like(v) for k, v in state.items()}
    out: dict[str, list[tuple[float, float]]] = {}

    def add(name: str, t: tuple[float, float]) -> None:
        out.setdefault(name, []).append(t)

    shm = Path("/dev/shm") if Path("/dev/shm").is_dir() else work
    mem = Path(tempfile.mkdtemp(prefix="fc-tensor-cost-", dir=shm))
    try:
        for r in range(repeats):
            path = work / f"torch-{r}.pt"

            def tsave(path: Path = path) -> None:
                with open(path, "wb") as f:
                    torch.save(state, f)
                    f.flush()
                    os.fsync(f.fileno())

            add("torch.save", _timed(tsave))
            add("torch.load", _timed(lambda path=path: torch.load(path, weights_only=True)))
            path.unlink()

            root = work / f"sync-{r}"
            with flashckpt.Checkpointer(root, incremental=False) as ck:
                add("flashckpt save (sync)", _timed(lambda ck=ck: ck.save(1, {"m": state})))
            with flashckpt.Checkpointer(root) as ck:
                add("flashckpt restore (disk)", _timed(lambda ck=ck: ck.restore({"m": target})))
            shutil.rmtree(root)

            root = work / f"async-{r}"
            with flashckpt.Checkpointer(
                root, async_save=True, incremental=False, memory_tier=mem / str(r)
            ) as ck:
                handle: list[Any] = []
                add(
                    "flashckpt save (async, blocking)",
                    _timed(lambda ck=ck, h=handle: h.append(ck.save(1, {"m": state}))),
                )
                t0 = time.perf_counter()
                handle[0].wait()
                add("flashckpt save (async, to durable)", (time.perf_counter() - t0, 0.0))
                ck.wait_promoted()
                add(
                    "flashckpt restore (memory tier)",
                    _timed(lambda ck=ck: ck.restore({"m": target})),
                )
            shutil.rmtree(root)
    finally:
        shutil.rmtree(mem, ignore_errors=True)
    per = {
        name: {
            "wall_us": statistics.median(w for w, _ in ts) / tensors * 1e6,
            "cpu_us": statistics.median(c for _, c in ts) / tensors * 1e6,
        }
        for name, ts in out.items()
    }
    return {"tensors": tensors, "numel": numel, "repeats": repeats, "methods": per}


def table(res: dict[str, Any]) -> str:
    m = res["methods"]
    rows = ["| method | wall us/tensor | CPU us/tensor | wall / torch |", "|---|---:|---:|---:|"]
    for name, r in m.items():
        ref = m["torch.load"] if "restore" in name or "load" in name else m["torch.save"]
        rows.append(
            f"| {name} | {r['wall_us']:.1f} | {r['cpu_us']:.1f} | "
            f"{r['wall_us'] / ref['wall_us']:.2f} |"
        )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tensors", type=int, default=50_000)
    p.add_argument("--numel", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dir", default=None)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="fc-tensor-cost-", dir=a.dir))
    try:
        res = run(tensors=a.tensors, numel=a.numel, repeats=a.repeats, work=work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(table(res))
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
