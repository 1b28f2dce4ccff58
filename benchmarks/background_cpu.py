"""What an open Checkpointer's threads take from training between saves.

    python benchmarks/background_cpu.py [--steps 20] [--threads 2] [--small]

Trains the chaos benchmark's demo GPT (370 MB of model + AdamW state; --small: a tiny one)
with ``torch.set_num_threads(--threads)``, saves twice (so the tiers hold checkpoints to scrub),
waits until they are durable, then trains --steps more steps calling ``should_save`` and never
saving, and prints the CPU seconds each thread of the process used in that window (from
``/proc/self/task``), flashckpt's threads by name, and the CPU the host left idle. Between
saves an open Checkpointer should take close to nothing; before the idle scrub waited for an
idle core (engine/runtime/hostcpu.py) its thread took 0.78-0.88 s per 13 s here. Linux only.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import threading
import time
from pathlib import Path

import torch

import flashckpt
from flashckpt.demo import chaos_train
from flashckpt.demo.chaos import MODEL, SMOKE_MODEL
from flashckpt.policy import Auto, KeepLast


def cpu_by_thread() -> dict[int, float]:
    out = {}
    tick = os.sysconf("SC_CLK_TCK")
    for tid in os.listdir("/proc/self/task"):
        try:
            fields = Path(f"/proc/self/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[int(tid)] = (int(fields[11]) + int(fields[12])) / tick
    return out


def idle_ticks() -> tuple[int, int]:
    v = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    return v[3] + v[4], sum(v)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--small", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cfg = {"seed": 0, "model": SMOKE_MODEL if args.small else MODEL, "batch_size": 8}
    state = chaos_train.build(cfg)
    with (
        tempfile.TemporaryDirectory(prefix="bgcpu-") as d,
        tempfile.TemporaryDirectory(
            prefix="bgcpu-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None
        ) as shm,
    ):
        ckpt = flashckpt.Checkpointer(
            Path(d) / "root", memory_tier=shm, async_save=True, save_policy=Auto(mtbf_s=60),
            keep=KeepLast(2), keep_memory=KeepLast(2),
        )  # fmt: skip
        step = 0
        for _ in range(2):
            for _ in range(3):
                step += 1
                chaos_train.train_step(cfg, state, step)
            ckpt.save(step, state)
        ckpt.wait()
        ckpt.wait_promoted(60)
        time.sleep(1.0)
        a, (i0, t0), w0 = cpu_by_thread(), idle_ticks(), time.perf_counter()
        for _ in range(args.steps):
            step += 1
            chaos_train.train_step(cfg, state, step)
            ckpt.should_save(step)
        b, (i1, t1), wall = cpu_by_thread(), idle_ticks(), time.perf_counter() - w0
        names = {t.native_id: t.name for t in threading.enumerate()}
        ckpt.close()
    print(f"{args.steps} steps in {wall:.2f} s; host idle {(i1 - i0) / max(1, t1 - t0):.1%}")
    ours = 0.0
    for tid in sorted(b, key=lambda t: a.get(t, 0) - b[t]):
        used = b[tid] - a.get(tid, 0.0)
        name = names.get(tid, "torch/OpenMP worker")
        if name.startswith("flashckpt"):
            ours += used
        if used >= 0.01 or name.startswith("flashckpt"):
            print(f"  {name:24s} {used:6.2f} s")
    print(f"flashckpt threads: {ours:.2f} s of CPU in {wall:.2f} s ({ours / wall:.1%} of a core)")


if __name__ == "__main__":
    main()
