"""What the disk tier's file churn costs: new files per save against recycled ones.

    python benchmarks/file_churn.py [--dir DIR] [--files 50] [--mib 5] [--rounds 12]

Each round writes ``--files`` chunk-sized files with O_DIRECT (temporary name, fsync, rename,
one directory fsync), as a save to the disk tier does, and drops the round before last
(``keep=2``). ``create``: every file is new and a dropped one is unlinked, as flashckpt's disk
tier does today; ``recycle``: a dropped file is renamed into a pool and the next file of its
size is written over it (``fdatasync``: its blocks are allocated already), as the memory tier
recycles its files. Prints wall time and the process's CPU per round. On a filesystem that
searches for free inodes past recently deleted ones (ext4 without a journal) or discards freed
blocks (``-o discard``) the difference is larger than on others.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import resource
import shutil
import tempfile
import time


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def churn(d: str, mode: str, files: int, size: int, rounds: int) -> dict[str, float]:
    buf = mmap.mmap(-1, size)  # page-aligned, for O_DIRECT
    buf.write(os.urandom(size))
    os.makedirs(d)
    free: list[str] = []
    kept: list[list[str]] = []
    t0, c0 = time.perf_counter(), _cpu()
    for r in range(rounds):
        new = []
        for i in range(files):
            name = f"{d}/c-{r}-{i}"
            if mode == "recycle" and free:
                os.rename(free.pop(), name + ".tmp")
                fd = os.open(name + ".tmp", os.O_WRONLY | os.O_DIRECT)
            else:
                flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_DIRECT
                fd = os.open(name + ".tmp", flags, 0o600)
            try:
                os.write(fd, buf)
                os.fdatasync(fd) if mode == "recycle" else os.fsync(fd)
            finally:
                os.close(fd)
            os.rename(name + ".tmp", name)
            new.append(name)
        dfd = os.open(d, os.O_RDONLY)
        os.fsync(dfd)
        os.close(dfd)
        if len(kept) >= 2:
            for old in kept.pop(0):
                if mode == "recycle":
                    os.rename(old, old + ".free")
                    free.append(old + ".free")
                else:
                    os.unlink(old)
        kept.append(new)
    return {
        "wall_ms": round((time.perf_counter() - t0) / rounds * 1e3, 1),
        "cpu_ms": round((_cpu() - c0) / rounds * 1e3, 1),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", default=None, help="a directory on the disk to measure")
    p.add_argument("--files", type=int, default=50)
    p.add_argument("--mib", type=int, default=5)
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--repeat", type=int, default=2)
    a = p.parse_args(argv)
    base = tempfile.mkdtemp(prefix="fc-churn-", dir=a.dir)
    out: dict[str, list[dict[str, float]]] = {"create": [], "recycle": []}
    try:
        for k in range(a.repeat):
            for mode in out:
                d = os.path.join(base, f"{mode}-{k}")
                out[mode].append(churn(d, mode, a.files, a.mib << 20, a.rounds))
                shutil.rmtree(d)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    print(json.dumps({"files": a.files, "mib": a.mib, "rounds": a.rounds, **out}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
