"""System calls and GIL waits per save in loop-cost's dispatch loop, counted with strace.

    python benchmarks/save_syscalls.py [--memory-tier] [--saves 12]

Runs one process twice under ``strace -f -c`` (Linux, strace on PATH): loop-cost's 256 MiB
state of 96 tensors trained with its dispatch loop (one thread, many small ops), once saving
every 10 steps and once without saves, and prints the difference per save: all system calls,
``futex`` (threads waiting for the GIL, mostly) and ``openat``. Every system call a save's
thread makes from Python is a hand-off of the GIL with a training thread that releases it at
each small operation, so these counts are a cost to the loop that host noise does not move.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

# loop-cost's state and dispatch loop in a child process (argv: "1" for a memory tier, saves);
# benchmarks/save_cpu.py starts its children with it too
SETUP = r"""
import sys, tempfile, shutil
from pathlib import Path
import torch, flashckpt
from flashckpt.cli.bench import cost
torch.set_num_threads(1)
memory, saves = sys.argv[1] == "1", int(sys.argv[2])
model, opt = cost._state(256 << 20, 96)
work = cost._work("dispatch")
root = Path(tempfile.mkdtemp(prefix="fc-bench-"))
mem = Path("/dev/shm") / (root.name + "-m") if memory else None
"""
CHILD = (
    SETUP
    + r"""
ck = flashckpt.Checkpointer(root, async_save=True, keep=2, memory_tier=mem) if saves else None
for s in range(1, 10 * max(saves, 1) + 1):
    work(); opt.step()
    if ck is not None and s % 10 == 0:
        ck.save(s, {"model": model, "optim": opt})
if ck is not None:
    ck.close()
shutil.rmtree(root, ignore_errors=True)
if mem: shutil.rmtree(mem, ignore_errors=True)
"""
)


def _counts(memory: bool, saves: int) -> dict[str, int]:
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "strace.txt"
        cmd = ["strace", "-f", "-c", "-o", str(out), sys.executable, "-c", CHILD]
        subprocess.run([*cmd, "1" if memory else "0", str(saves)], check=True, timeout=900)
        counts: dict[str, int] = {}
        for line in out.read_text().splitlines():
            f = line.split()
            if len(f) >= 5 and f[3].isdigit():
                counts[f[-1]] = int(f[3])
        return counts


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--memory-tier", action="store_true", help="a memory tier in /dev/shm")
    p.add_argument("--saves", type=int, default=12)
    a = p.parse_args(argv)
    if shutil.which("strace") is None or not sys.platform.startswith("linux"):
        print("strace (Linux) is needed", file=sys.stderr)
        return 2
    with_saves, without = _counts(a.memory_tier, a.saves), _counts(a.memory_tier, 0)
    per = {
        k: round((with_saves.get(k, 0) - without.get(k, 0)) / a.saves)
        for k in ("total", "futex", "openat", "close", "newfstatat")
    }
    print(json.dumps({"memory_tier": a.memory_tier, "saves": a.saves, "per_save": per}))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONHASHSEED", "0")
    raise SystemExit(main())
