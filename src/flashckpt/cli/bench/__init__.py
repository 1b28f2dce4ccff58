"""``flashckpt bench``: flashckpt side by side with torch.save, DCP and the raw device.

Runs the save benchmark (every method on the same state), host RSS over many saves, the GIL
probe (persist in threads vs a process) and the training-loop benchmark; prints a markdown
table with ratios against the targets and writes everything as JSON. The measuring code lives
in :mod:`flashckpt.cli.bench.impl` and :mod:`flashckpt.cli.bench.loop`;
``benchmarks/save_bench.py`` calls the same code.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from flashckpt.cli import argtypes
from flashckpt.cli.bench.impl import SaveBenchConfig, run_save_bench
from flashckpt.cli.bench.loop import LoopConfig, run_gil_probe, run_loop_bench, run_rss_series
from flashckpt.errors import ConfigError

PARTS = ("save", "rss", "gil", "loop", "loop-cost")
DEFAULT_PARTS = ("save", "rss", "gil", "loop")  # loop-cost (minutes) only when asked for
MiB = 1 << 20


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "bench",
        help="benchmark saves against torch.save, DCP and the raw disk (table + JSON)",
        description="Save the same state with torch.save, dcp.save, dcp.async_save, flashckpt "
        "sync/async/incremental and a raw sequential write (all fsynced); measure RSS over "
        "saves, background-persist GIL cost and training-loop overhead. Prints a markdown "
        "table with PASS/FAIL per target and writes JSON.",
    )
    p.add_argument(
        "--size-gb", type=argtypes.size_gb, default=1.2, help="state size in GB (default 1.2)"
    )
    p.add_argument("--out", default="bench.json", help="JSON file to write (default bench.json)")
    p.add_argument(
        "--dir", default=None, help="where saves are written (default: a temp dir on disk)"
    )
    p.add_argument("--quick", action="store_true", help="tiny sizes, one repeat (a smoke test)")
    p.add_argument("--gpu", action="store_true", help="state and model on CUDA")
    p.add_argument("--repeats", type=argtypes.count, default=3, help="repeats per method (median)")
    p.add_argument(
        "--parts",
        default=",".join(DEFAULT_PARTS),
        help=f"comma-separated subset of {','.join(PARTS)} (default {','.join(DEFAULT_PARTS)}; "
        "loop-cost: what a save costs a training loop in three loop profiles, side by side with "
        "torch.save, dcp.async_save and a memcpy, also benchmarks/loop_cost.py)",
    )
    p.set_defaults(func=run)


@dataclass(frozen=True, kw_only=True)
class Plan:
    size_bytes: int
    repeats: int
    device: str
    rss_bytes: int
    rss_saves: int
    gil_bytes: int
    probe_s: float = 1.5
    drop_caches: bool = True
    loop: dict[str, int]


def make_plan(args: argparse.Namespace) -> Plan:
    if args.gpu and not torch.cuda.is_available():
        raise ConfigError("--gpu needs a CUDA device; torch.cuda.is_available() is False")
    if args.size_gb <= 0 or args.repeats < 1:
        raise ConfigError("--size-gb must be > 0 and --repeats >= 1")
    device = "cuda" if args.gpu else "cpu"
    if args.quick:
        loop = {"steps": 4, "every": 2, "n_embd": 48, "n_head": 4, "n_layer": 2, "batch": 2,
                "block": 16}  # fmt: skip
        return Plan(size_bytes=16 * MiB, repeats=1, device=device, rss_bytes=2 * MiB,
                    rss_saves=40, gil_bytes=16 * MiB, probe_s=0.3, drop_caches=False,
                    loop=loop)  # fmt: skip
    size = int(args.size_gb * 1e9)
    if args.gpu:
        loop = {"steps": 150, "every": 50, "n_embd": 1024, "n_head": 8, "n_layer": 8,
                "batch": 16, "block": 256}  # fmt: skip
    else:
        loop = {"steps": 60, "every": 10, "n_embd": 512, "n_head": 8, "n_layer": 6, "batch": 4,
                "block": 32, "rounds": args.repeats}  # fmt: skip
    return Plan(size_bytes=size, repeats=args.repeats, device=device,
                rss_bytes=min(size // 8, 128 * MiB), rss_saves=40,
                gil_bytes=min(size // 2, 512 * MiB), loop=loop)  # fmt: skip


def default_dir() -> Path:
    """A temp dir on a real disk: the system temp dir unless it is tmpfs, else the cwd."""
    base = Path(tempfile.gettempdir())
    if _fs_type(base) in ("tmpfs", "ramfs"):
        base = Path.cwd()
    return Path(tempfile.mkdtemp(prefix="flashckpt-bench-", dir=base))


def _fs_type(path: Path) -> str:
    best, kind = "", ""
    try:
        with open("/proc/mounts") as f:
            for line in f:
                fields = line.split()
                mnt = fields[1]
                if str(path.resolve()).startswith(mnt) and len(mnt) > len(best):
                    best, kind = mnt, fields[2]
    except OSError:
        return ""
    return kind


def machine(root: Path) -> dict[str, Any]:
    cpu = ""
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if "model name" in ln), "")
    except OSError:
        pass
    df = subprocess.run(["df", "-h", str(root)], capture_output=True, text=True).stdout
    info: dict[str, Any] = {
        "nproc": os.cpu_count(),
        "cpu": cpu,
        "mem_total_gb": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9, 1),
        "disk": df.strip().splitlines()[-1] if df.strip() else "",
        "fs_type": _fs_type(root),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def run_parts(plan: Plan, root: Path, parts: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if "save" in parts:
        cfg = SaveBenchConfig(
            size_bytes=plan.size_bytes,
            root=root / "save",
            repeats=plan.repeats,
            device=plan.device,
            drop_caches=plan.drop_caches,
        )
        out["save"] = run_save_bench(cfg)
    if "rss" in parts:
        out["rss"] = run_rss_series(
            root / "rss", plan.rss_bytes, saves=plan.rss_saves, device=plan.device
        )
    if "gil" in parts:
        out["gil"] = run_gil_probe(root / "gil", plan.gil_bytes, alone_s=plan.probe_s)
    if "loop" in parts:
        out["loop"] = run_loop_bench(
            LoopConfig(root=root / "loop", device=plan.device, **plan.loop)
        )
    if "loop-cost" in parts:
        from flashckpt.cli.bench import cost as bench_cost

        small = plan.size_bytes < 64 * MiB  # --quick
        out["loop_cost"] = bench_cost.run(
            state_bytes=min(plan.size_bytes, 256 * MiB),
            steps=14 if small else 70,
            every=4 if small else 10,
            work_dir=str(root),
            say=lambda m: print(m, file=sys.stderr),
        )
    return out


def run(args: argparse.Namespace) -> int:
    from flashckpt.cli.bench.report import render, targets

    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    bad = [p for p in parts if p not in PARTS]
    if bad:
        raise ConfigError(f"--parts: unknown {bad}; choose from {','.join(PARTS)}")
    plan = make_plan(args)
    root = Path(args.dir) if args.dir else default_dir()
    root.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="run-", dir=root))
    try:
        result: dict[str, Any] = {"machine": machine(root), "plan": plan.__dict__}
        result.update(run_parts(plan, work, parts))
    finally:
        shutil.rmtree(work, ignore_errors=True)
        if not args.dir:
            shutil.rmtree(root, ignore_errors=True)
    result["targets"] = targets(result)
    print(render(result))
    if "loop_cost" in result:
        from flashckpt.cli.bench.cost import table

        print("\n### What a save costs the loop (ms per save)\n\n" + table(result["loop_cost"]))
    Path(args.out).write_text(json.dumps(result, indent=1, default=str) + "\n")
    print(f"\nwrote {args.out}")
    return 0
