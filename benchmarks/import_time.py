"""What ``import flashckpt`` adds to ``import torch``, measured inside a fresh interpreter:
after ``import torch``, the CPU and wall seconds of the flashckpt import line alone (median of N
runs), for one or more source trees side by side (interleaved, so machine load hits them alike).
Bytecode is cached in a private PYTHONPYCACHEPREFIX, as in an installed package
(PYTHONDONTWRITEBYTECODE is dropped).

    python benchmarks/import_time.py --runs 7 before=/tmp/old/src after=src

Timing only the line after torch keeps torch's own import (seconds, and noisy on a shared
machine) out of the difference.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

LINES = {
    "import flashckpt": "import flashckpt",
    "from flashckpt import Checkpointer": "from flashckpt import Checkpointer",
}
PROBE = """
import json, time
import torch
c, w = time.process_time(), time.perf_counter()
{line}
print(json.dumps([time.process_time() - c, time.perf_counter() - w]))
"""


def measure(src: str, line: str, env: dict[str, str]) -> tuple[float, float]:
    out = subprocess.run(
        [sys.executable, "-c", PROBE.format(line=line)],
        env={**env, "PYTHONPATH": src},
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    cpu, wall = json.loads(out)
    return cpu, wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trees", nargs="+", metavar="NAME=SRC", help="source trees to compare")
    ap.add_argument("--runs", type=int, default=7)
    args = ap.parse_args()
    trees = dict(t.split("=", 1) for t in args.trees)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env["PYTHONPYCACHEPREFIX"] = tempfile.mkdtemp(prefix="flashckpt-pyc-")
    for src in trees.values():  # compile once, as pip does on install
        measure(src, LINES["from flashckpt import Checkpointer"], env)
    res: dict[tuple[str, str], list[tuple[float, float]]] = {}
    for _ in range(args.runs):
        for name, src in trees.items():
            for label, line in LINES.items():
                res.setdefault((name, label), []).append(measure(src, line, env))
    print(f"load average {os.getloadavg()[0]:.1f}, {args.runs} runs, median seconds after torch")
    for (name, label), vals in res.items():
        cpu = statistics.median(v[0] for v in vals)
        wall = statistics.median(v[1] for v in vals)
        print(f"{name:8s} {label:36s} cpu {cpu:.3f} wall {wall:.3f}")


if __name__ == "__main__":
    main()
