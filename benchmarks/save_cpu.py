"""CPU a save's background threads take, and its time to durable, in loop-cost's dispatch loop.

    python benchmarks/save_cpu.py [--tiers disk,memory] [--saves 12] [--rounds 3]

Each run is a fresh process: loop-cost's 256 MiB state of 96 tensors trained with its dispatch
loop (one thread, many small ops), saving asynchronously every 10 steps to the disk tier alone
or with a memory tier in /dev/shm, then closing the Checkpointer (so every promotion is in).
It prints the CPU (user + system) of every thread but the training thread, per save: what the
save's threads take from the cores training could use, and the median time from ``save()``
to durable of the saves after the third (retention freeing files by then). Wall time of the
loop on a shared
2-vCPU VM moves by more than a few tens of milliseconds from run to run; this count does much
less. Tiers alternate, ``--rounds`` times, so a drift of the host hits both alike.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from save_syscalls import SETUP  # the child's state and loop (this directory is on sys.path)

CHILD = (
    SETUP
    + r"""
import json, resource, statistics
ck = flashckpt.Checkpointer(root, async_save=True, keep=2, memory_tier=mem)
def cpu(who):
    r = resource.getrusage(who)
    return r.ru_utime + r.ru_stime
for _ in range(10):
    work(); opt.step()
p0, m0 = cpu(resource.RUSAGE_SELF), cpu(resource.RUSAGE_THREAD)
handles = []
for s in range(1, 10 * saves + 1):
    work(); opt.step()
    if s % 10 == 0:
        handles.append(ck.save(s, {"model": model, "optim": opt}))
ck.close()
p1, m1 = cpu(resource.RUSAGE_SELF), cpu(resource.RUSAGE_THREAD)
durable = statistics.median(h.durable.result().background_s for h in handles[3:])
print(json.dumps({"background_ms": ((p1 - p0) - (m1 - m0)) / saves * 1e3,
                  "durable_ms": durable * 1e3}))
shutil.rmtree(root, ignore_errors=True)
if mem: shutil.rmtree(mem, ignore_errors=True)
"""
)


def _run(tier: str, saves: int) -> dict[str, float]:
    out = subprocess.run(
        [sys.executable, "-c", CHILD, "1" if tier == "memory" else "0", str(saves)],
        check=True,
        capture_output=True,
        text=True,
        timeout=900,
    ).stdout
    got = json.loads(out.strip().splitlines()[-1])
    return {k: round(float(v), 1) for k, v in got.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiers", default="disk,memory")
    p.add_argument("--saves", type=int, default=12, help="at least 4")
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args(argv)
    tiers = [t for t in a.tiers.split(",") if t]
    if any(t not in ("disk", "memory") for t in tiers):
        print("--tiers takes disk and/or memory", file=sys.stderr)
        return 2
    got: dict[str, list[dict[str, float]]] = {t: [] for t in tiers}
    for _ in range(a.rounds):
        for t in tiers:
            got[t].append(_run(t, a.saves))
    print(json.dumps({"saves": a.saves, "per_save": got}))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONHASHSEED", "0")
    raise SystemExit(main())
