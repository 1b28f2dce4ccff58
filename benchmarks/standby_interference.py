"""What a starting standby costs the training beside it, by how it is started.

    python benchmarks/standby_interference.py [--rounds 3] [--threads 2]

Trains the chaos benchmark's GPT (``flashckpt.demo.chaos_train``: the same model, batch and
optimizer) for 12 steps on ``--threads`` torch threads; after step 1 it starts a second Python
process that does what a warm standby does before it waits: imports torch and flashckpt,
builds the same model and AdamW, imports ``torch._dynamo``, then sleeps. Prints, per way of
starting it, the median over ``--rounds`` of the training's extra seconds in steps 2-12 against
the same steps with no second process (run in the same rounds, alternating):

- ``normal``: nice 0, in this session;
- ``idle-own-session``: ``SCHED_IDLE`` in a session of its own (``start_new_session``: what
  ``flashckpt run --standby`` did before; with the kernel's autogroups each session is a
  scheduler group of its own, and groups share the CPU fairly whatever the policy inside);
- ``idle-same-session``: ``SCHED_IDLE`` in its own process group of this session (what it does
  now: distributed/standby/procs.py).

Also prints ``/proc/sys/kernel/sched_autogroup_enabled``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from flashckpt.demo.chaos_train import build, train_step

CFG = {
    "seed": 0,
    "model": {"block_size": 128, "n_layer": 7, "n_head": 8, "n_embd": 512},
    "batch_size": 8,
}
STEPS = 12
CHILD = (
    "import torch, flashckpt, time\n"
    "from flashckpt.demo.chaos_train import build\n"
    "torch.set_num_threads({threads})\n"
    "state = build({cfg!r})\n"
    "import torch._dynamo\n"
    "time.sleep(60)\n"
)


def _idle() -> None:
    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))


def _idle_own_group() -> None:
    os.setpgid(0, 0)  # what distributed/standby/procs.py does
    _idle()


def run(mode: str, threads: int, state: dict) -> list[float]:
    """Step times of STEPS steps, the second process started after step 1 (``mode``)."""
    proc = None
    times = []
    for step in range(1, STEPS + 1):
        if step == 2 and mode != "none":
            proc = subprocess.Popen(
                [sys.executable, "-c", CHILD.format(threads=threads, cfg=CFG)],
                preexec_fn={"normal": None, "idle-own-session": _idle}.get(mode, _idle_own_group),
                start_new_session=mode == "idle-own-session",
            )
        t0 = time.perf_counter()
        train_step(CFG, state, step)
        times.append(time.perf_counter() - t0)
    if proc is not None:
        proc.kill()
        proc.wait()
    return times


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    state = build(CFG)
    run("none", a.threads, state)  # warm-up
    modes = ["none", "normal", "idle-own-session", "idle-same-session"]
    excess: dict[str, list[float]] = {m: [] for m in modes[1:]}
    steps: dict[str, list[float]] = {m: [] for m in modes}
    for _ in range(a.rounds):
        base = sum(run("none", a.threads, state)[1:])
        steps["none"].append(base / (STEPS - 1))
        for m in modes[1:]:
            got = sum(run(m, a.threads, state)[1:])
            steps[m].append(got / (STEPS - 1))
            excess[m].append(got - base)
            base = sum(run("none", a.threads, state)[1:])  # the baseline beside each
            steps["none"].append(base / (STEPS - 1))
    try:
        autogroup = Path("/proc/sys/kernel/sched_autogroup_enabled").read_text().strip()
    except OSError:
        autogroup = "absent"
    print(f"sched_autogroup_enabled: {autogroup}; {a.threads} torch threads; {os.cpu_count()} CPUs")
    print(f"step time alone: {statistics.median(steps['none']):.3f} s (median)")
    print("| second process started | training's extra seconds, steps 2-12 (median) | runs |")
    print("|---|---:|---|")
    for m in modes[1:]:
        runs = " · ".join(f"{x:+.2f}" for x in excess[m])
        print(f"| {m} | {statistics.median(excess[m]):+.2f} s | {runs} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
