"""What ``import flashckpt`` adds to ``import torch``: CPU seconds (user + sys) of a fresh
interpreter per import line, median of N runs, for one or more source trees side by side
(interleaved, so machine load hits them alike). Bytecode is cached in a private
PYTHONPYCACHEPREFIX, as in an installed package (PYTHONDONTWRITEBYTECODE is dropped).

    python benchmarks/import_time.py --runs 9 before=/tmp/old/src after=src

CPU time, not wall time: on a shared machine wall time mostly measures the other processes.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile

LINES = {
    "torch": "import torch",
    "torch+flashckpt": "import torch, flashckpt",
    "torch+Checkpointer": "import torch; from flashckpt import Checkpointer",
}


def cpu_s(src: str, code: str, env: dict[str, str]) -> float:
    pid = os.fork()
    if pid == 0:
        os.execve(sys.executable, [sys.executable, "-c", code], {**env, "PYTHONPATH": src})
    _, status, usage = os.wait4(pid, 0)
    if status != 0:
        raise SystemExit(f"{code!r} failed with PYTHONPATH={src}")
    return usage.ru_utime + usage.ru_stime


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trees", nargs="+", metavar="NAME=SRC", help="source trees to compare")
    ap.add_argument("--runs", type=int, default=9)
    args = ap.parse_args()
    trees = dict(t.split("=", 1) for t in args.trees)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env["PYTHONPYCACHEPREFIX"] = tempfile.mkdtemp(prefix="flashckpt-pyc-")
    for src in trees.values():  # compile once, as pip does on install
        for code in LINES.values():
            cpu_s(src, code, env)
    res: dict[tuple[str, str], list[float]] = {}
    for _ in range(args.runs):
        for name, src in trees.items():
            for line, code in LINES.items():
                res.setdefault((name, line), []).append(cpu_s(src, code, env))
    print(f"load average {os.getloadavg()[0]:.1f}, {args.runs} runs, CPU seconds (median)")
    for name in trees:
        base = statistics.median(res[(name, "torch")])
        extra = ", ".join(
            f"{line} +{statistics.median(res[(name, line)]) - base:.3f}"
            for line in LINES
            if line != "torch"
        )
        print(f"{name:8s} torch {base:.3f} · {extra}")


if __name__ == "__main__":
    main()
