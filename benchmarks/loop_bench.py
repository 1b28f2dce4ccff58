"""Training-loop benchmark.

    python benchmarks/loop_bench.py --out loop.json [--gpu]

runs ``flashckpt bench --parts loop``: step time of the demo GPT with no checkpoints vs a
checkpoint every k steps with torch.save (sync), dcp.async_save and flashckpt async.

    python benchmarks/loop_bench.py --cold --parts blocking [--size-gb 1.2] [--dir DIR]
    python benchmarks/loop_bench.py --cold --parts loop [--dir DIR] [--out cold.json]

the cold first save, every measurement in a fresh process, side by side in one run:

1. *blocking*: the first and the later saves of a ~1.2 GB state (MLP + AdamW) with nothing to
   overlap — flashckpt async after a restart (a checkpoint of the state is in the root; the
   process constructs the Checkpointer, restores, saves), the same with a memory tier in
   /dev/shm after a SIGKILL (``flashckpt_restart_memory``: the killed run leaves its staging
   arena there, engine/tiers/arena.py), flashckpt async in an empty root,
   ``dcp.async_save`` (until it returns: its default stager copies synchronously) and
   ``torch.save`` + fsync;
2. *extra loop time*: a demo-GPT training loop (state ~110 MB) saving at its 4th step (the
   first save) and its 12th (warm), with training on one intra-op thread and on every core;
   extra = the step times from the save step on (6 steps) minus 6 median steps without one.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

FIRST, WARM, WINDOW, STEPS = 4, 12, 6, 18
SAVES = 2  # per process in the blocking part: the first, and one warm


# -- in the child process ---------------------------------------------------------------------
def _mlp(size_gb: float) -> dict[str, Any]:
    from flashckpt.cli.bench.impl import build_state

    model, opt = build_state(int(size_gb * 1e9))
    return {"model": model, "optim": opt}


def _bump(state: dict[str, Any]) -> None:
    with torch.no_grad():
        for p in state["model"].parameters():
            p.add_(1)


def _memory_dir(root: Path) -> Path:
    """The /dev/shm memory tier of a ``flashckpt_restart_memory`` root."""
    return Path("/dev/shm") / f"fc-cold-{hashlib.sha1(str(root).encode()).hexdigest()[:12]}"


def _saver(method: str, root: Path) -> Any:
    """``save(step, state) -> wait_staged()`` for one method; blocking = both together."""
    if method.startswith("flashckpt"):
        from flashckpt import Checkpointer

        mem = _memory_dir(root) if method == "flashckpt_restart_memory" else None
        ck = Checkpointer(root, async_save=True, memory_tier=mem)
        return ck
    return None


def _one_save(method: str, ck: Any, root: Path, step: int, state: dict[str, Any]) -> Any:
    if ck is not None:
        return ck.save(step, state)
    sd = {k: v.state_dict() for k, v in state.items()}
    if method == "torch_save":
        from flashckpt.cli.bench.impl import fsync_dir

        with open(root / f"t{step}.pt", "wb") as f:
            torch.save(sd, f)
            f.flush()
            os.fsync(f.fileno())
        fsync_dir(root)
        return None
    import torch.distributed.checkpoint as dcp

    writer = dcp.FileSystemWriter(str(root / f"dcp{step}"), sync_files=True)
    return dcp.async_save(sd, storage_writer=writer, no_dist=True)


def child_blocking(method: str, root: Path, size_gb: float) -> dict[str, Any]:
    state = _mlp(size_gb)
    root.mkdir(parents=True, exist_ok=True)
    ck = _saver(method, root)
    out: dict[str, Any] = {"blocking_s": []}
    if method.startswith("flashckpt_restart"):
        t0 = time.perf_counter()
        out["restored"] = ck.restore(state)
        out["restore_s"] = time.perf_counter() - t0
    if ck is not None:  # was the background warm-up done when the first save came?
        out["warmup_done_at_first_save"] = ck._warmup.done.is_set()
        out["arena_touched_bytes"] = ck._pool.touched_bytes
        out["arena_file_backed"] = ck._pool.file_backed
        out["arena_reused_bytes"] = ck._pool.reused_bytes
    pending = None
    for i in range(SAVES):
        _bump(state)
        if pending is not None:  # the previous save ends before the next (not timed)
            pending.result() if hasattr(pending, "result") else pending.wait()
        t0 = time.perf_counter()
        pending = _one_save(method, ck, root, 100 + i, state)
        if ck is not None:
            pending.staged.result()  # no optimizer step to overlap: blocked until staged
        out["blocking_s"].append(time.perf_counter() - t0)
    if pending is not None:
        pending.result() if hasattr(pending, "result") else pending.wait()
    if ck is not None:
        ck.close()
    return out


def _gpt() -> tuple[Any, Any, Any]:
    from flashckpt.demo.model import GPT, GPTConfig

    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=96, block_size=32, n_layer=6, n_head=8, n_embd=512)
    model = GPT(cfg)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4), cfg


def child_loop(method: str, root: Path, threads: int) -> dict[str, Any]:
    torch.set_num_threads(threads)
    model, opt, cfg = _gpt()
    state = {"model": model, "optim": opt}
    g = torch.Generator().manual_seed(1)

    def step() -> None:
        idx = torch.randint(cfg.vocab_size, (4, cfg.block_size + 1), generator=g)
        loss = model(idx[:, :-1], idx[:, 1:])[1]
        opt.zero_grad(set_to_none=True)
        loss.backward()  # type: ignore[union-attr]
        opt.step()

    for _ in range(3):
        step()
    root.mkdir(parents=True, exist_ok=True)
    ck = _saver(method, root)
    if method == "flashckpt_restart":
        ck.restore(state)
    pending, times, calls = None, [], {}
    for s in range(1, STEPS + 1):
        t0 = time.perf_counter()
        step()
        if s in (FIRST, WARM):
            if pending is not None and hasattr(pending, "result"):
                pending.result()
            c0 = time.perf_counter()
            pending = _one_save(method, ck, root, s, state)
            calls[s] = time.perf_counter() - c0
        times.append(time.perf_counter() - t0)
    if pending is not None and hasattr(pending, "result"):
        pending.result()
    if ck is not None:
        ck.close()
    quiet = [t for i, t in enumerate(times, 1) if not (FIRST <= i < FIRST + WINDOW or i >= WARM)]
    base = statistics.median(quiet)

    def extra(at: int) -> float:
        return sum(times[at - 1 : at - 1 + WINDOW]) - WINDOW * base

    return {"step_s": base, "first_extra_s": extra(FIRST), "warm_extra_s": extra(WARM),
            "calls_s": calls, "steps_s": times}  # fmt: skip


def child_seed(root: Path, what: str, size_gb: float) -> dict[str, Any]:
    from flashckpt import Checkpointer

    state = _mlp(size_gb) if what == "mlp" else dict(zip(("model", "optim"), _gpt()[:2]))
    with Checkpointer(root) as ck:
        ck.save(1, state)
    return {}


def child_seed_killed(root: Path, size_gb: float) -> None:
    """The run before a ``flashckpt_restart_memory`` restart: an async save to the memory tier,
    durable, then SIGKILL (it leaves the memory tier and its staging arena in /dev/shm)."""
    state = _mlp(size_gb)
    ck = _saver("flashckpt_restart_memory", root)
    ck.save(1, state).durable.result()
    os.kill(os.getpid(), signal.SIGKILL)


# -- the parent -------------------------------------------------------------------------------
def _run_child(*args: str) -> dict[str, Any]:
    res = subprocess.run(
        [sys.executable, __file__, "--child", *args], capture_output=True, text=True, timeout=600
    )
    if res.returncode != 0:
        raise RuntimeError(f"child {args} failed: {res.stderr[-2000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def cold(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="loop_bench.py --cold")
    p.add_argument("--cold", action="store_true")
    p.add_argument("--size-gb", type=float, default=1.2)
    p.add_argument("--dir", default=None)
    p.add_argument("--out", default="cold.json")
    p.add_argument("--parts", default="blocking,loop")
    every = "flashckpt_restart,flashckpt_restart_memory,dcp_async_save,torch_save,flashckpt_fresh"
    p.add_argument("--methods", default=every)
    p.add_argument("--threads", default=f"1,{os.cpu_count() or 1}", help="loop part")
    args = p.parse_args(argv)
    base = Path(args.dir) if args.dir else Path(tempfile.gettempdir())
    base.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="cold-", dir=base))
    out: dict[str, Any] = {"load_avg_start": os.getloadavg(), "size_gb": args.size_gb}
    size = str(args.size_gb)
    try:
        if "blocking" in args.parts:
            methods = args.methods.split(",")
            if "flashckpt_restart" in methods:  # the run before the restart
                child_seed(work / "b_flashckpt_restart", "mlp", args.size_gb)
            if "flashckpt_restart_memory" in methods:  # killed, its memory tier left behind
                root = work / "b_flashckpt_restart_memory"
                cmd = [sys.executable, __file__, "--child", "seed-killed", str(root), size]
                res = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
                if res.returncode != -signal.SIGKILL:
                    raise RuntimeError(f"the killed seed run ended {res.returncode}: {res.stderr}")
            out["blocking"] = {}
            for m in methods:
                out["blocking"][m] = _run_child("blocking", m, str(work / f"b_{m}"), size)
                print(m, out["blocking"][m], flush=True)
                shutil.rmtree(work / f"b_{m}", ignore_errors=True)
                shutil.rmtree(_memory_dir(work / f"b_{m}"), ignore_errors=True)
            for m, r in out["blocking"].items():
                b = r["blocking_s"]
                print(f"blocking {m}: first {b[0]:.3f} s, warm {statistics.median(b[1:]):.3f} s")
                sys.stdout.flush()

        if "loop" in args.parts:
            out["loop"] = {}
            for threads in [int(t) for t in args.threads.split(",")]:
                skip = ("flashckpt_fresh", "flashckpt_restart_memory")  # the blocking part only
                for m in [m for m in args.methods.split(",") if m not in skip]:
                    root = work / f"l_{m}_{threads}"
                    if m == "flashckpt_restart":
                        child_seed(root, "gpt", 0.0)
                    r = _run_child("loop", m, str(root), str(threads))
                    out["loop"][f"{m}@{threads}"] = r
                    print(
                        f"loop {m} threads={threads}: step {r['step_s']:.3f} s, extra first "
                        f"{r['first_extra_s']:.3f} s, warm {r['warm_extra_s']:.3f} s",
                        flush=True,
                    )
                    shutil.rmtree(root, ignore_errors=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    out["load_avg_end"] = os.getloadavg()
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"load average {out['load_avg_start']} -> {out['load_avg_end']}; wrote {args.out}")
    return 0


def child(argv: list[str]) -> int:
    kind = argv[0]
    if kind == "seed":
        res = child_seed(Path(argv[1]), argv[2], float(argv[3]))
    elif kind == "seed-killed":
        child_seed_killed(Path(argv[1]), float(argv[2]))
        return 1  # not reached: SIGKILL
    elif kind == "blocking":
        res = child_blocking(argv[1], Path(argv[2]), float(argv[3]))
    else:
        res = child_loop(argv[1], Path(argv[2]), int(argv[3]))
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        sys.exit(child(sys.argv[2:]))
    if "--cold" in sys.argv[1:]:
        sys.exit(cold(sys.argv[1:]))
    from flashckpt.cli import main

    sys.exit(main(["bench", "--parts", "loop", *sys.argv[1:]]))
