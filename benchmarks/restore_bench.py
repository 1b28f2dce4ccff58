"""Restore throughput against this machine's own limits, measured in one run.

    python benchmarks/restore_bench.py [--size 1GiB] [--dir DIR] [--shm /dev/shm] [--repeats 3]
                                       [--json out.json] [--no-peers]

The state looks like an LLM trained with AdamW: a GPT's parameters (embedding, per layer qkv /
proj / mlp / norms) with ``exp_avg``, ``exp_avg_sq`` and a ``step`` per parameter, random fp32
values (incompressible), as a flat ``{name: tensor}`` dict that every method restores in place.

It runs ``--repeats`` rounds; each round measures, back to back in the same process:

- **memcpy**: ``torch.Tensor.copy_`` between two large buffers on 1 thread and on all threads,
  and numpy's copy (glibc ``memcpy``, 1 thread);
- **flashckpt from the memory tier**: restore of a checkpoint saved with ``memory_tier=--shm``;
- **the memory tier's floor**: its chunk files read (no hash) into one buffer by one thread per
  CPU (on a tmpfs the kernel's per-page work, not memcpy, bounds a read);
- **raw read**: a file of the state's size on ``--dir`` read sequentially in 16 MiB pieces with
  the page cache dropped, buffered (like ``dd bs=16M``) and with ``O_DIRECT``;
- **flashckpt from the disk**: the same checkpoint's local copy, page cache dropped (cold), then
  again (warm).

Ratios (restore / memcpy, disk restore / best raw read) are taken inside each round, because
the machine's load moves between rounds; the median over rounds is reported, with each
round's value. Then, unless ``--no-peers``: ``torch.load``, ``torch.load(mmap=True)`` and
``dcp.load`` of the same tensors from the memory tier's filesystem and from the disk (cold),
each ending with the same live tensors filled (``copy_`` from what was loaded; DCP loads in
place), best of ``--repeats``.

The page cache is dropped with ``sync; echo 3 > /proc/sys/vm/drop_caches`` (root) and, when
that is refused, by ``posix_fadvise(DONTNEED)`` on every file of ``--dir``. The load average
at the start and end is printed and written to the JSON (the machine may be shared).
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch

import flashckpt
from flashckpt.units import format_bytes, parse_bytes

PIECE = 16 << 20


def llm_state(nbytes: int, *, seed: int = 0) -> dict[str, torch.Tensor]:
    """A GPT-like fp32 model plus AdamW state of about ``nbytes`` (parameters are 1/3)."""
    g = torch.Generator().manual_seed(seed)
    d, vocab = 768, 16384
    layer = [
        ("ln1.weight", (d,)),
        ("ln1.bias", (d,)),
        ("attn.qkv.weight", (3 * d, d)),
        ("attn.qkv.bias", (3 * d,)),
        ("attn.proj.weight", (d, d)),
        ("attn.proj.bias", (d,)),
        ("ln2.weight", (d,)),
        ("ln2.bias", (d,)),
        ("mlp.fc.weight", (4 * d, d)),
        ("mlp.fc.bias", (4 * d,)),
        ("mlp.proj.weight", (d, 4 * d)),
        ("mlp.proj.bias", (d,)),
    ]
    per_layer = sum(_numel(s) for _, s in layer) * 4 * 3
    fixed = (vocab * d + 1024 * d + 2 * d) * 4 * 3
    layers = max(1, round((nbytes - fixed) / per_layer))
    shapes = [("wte.weight", (vocab, d)), ("wpe.weight", (1024, d))]
    shapes += [(f"h.{i}.{n}", s) for i in range(layers) for n, s in layer]
    shapes += [("ln_f.weight", (d,)), ("ln_f.bias", (d,))]
    out: dict[str, torch.Tensor] = {}
    for name, shape in shapes:
        out[f"model.{name}"] = torch.randn(shape, generator=g)
        out[f"optim.{name}.exp_avg"] = torch.randn(shape, generator=g) * 1e-3
        out[f"optim.{name}.exp_avg_sq"] = torch.rand(shape, generator=g) * 1e-6
        out[f"optim.{name}.step"] = torch.tensor(1000.0)
    return out


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def nbytes_of(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


# -- the machine's limits -----------------------------------------------------------------------
def drop_caches(d: Path) -> str:
    """Drop the page cache; returns how ("drop_caches" or "fadvise")."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return "drop_caches"
    except OSError:
        for dirpath, _, files in os.walk(d):
            for name in files:
                fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
                try:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)
        return "fadvise"


def best(fn: Callable[[], None], repeats: int, before: Callable[[], object] | None = None) -> float:
    times = []
    for _ in range(repeats):
        if before is not None:
            before()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def memcpy_gbps(src: torch.Tensor, dst: torch.Tensor) -> dict[str, float]:
    """One measurement of each memcpy: ``Tensor.copy_`` on 1 thread and on all threads, and
    numpy's copy (glibc memcpy, 1 thread)."""
    n = src.numel()
    threads = torch.get_num_threads()
    out = {}
    try:
        for label, k in (("memcpy_1_thread", 1), ("memcpy_all_threads", os.cpu_count() or 1)):
            torch.set_num_threads(k)
            out[label] = n / best(lambda: dst.copy_(src), 1) / 1e9
    finally:
        torch.set_num_threads(threads)
    out["memcpy_numpy_1_thread"] = n / best(lambda: np.copyto(dst.numpy(), src.numpy()), 1) / 1e9
    return out


def raw_file(d: Path, nbytes: int) -> Path:
    path = d / "raw-read.bin"
    block = os.urandom(PIECE)
    with open(path, "wb") as f:
        for _ in range(max(1, nbytes // PIECE)):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())
    return path


def raw_read_gbps(path: Path, d: Path) -> dict[str, float]:
    """One cold sequential read of ``path`` in 16 MiB pieces, buffered and with O_DIRECT."""
    size = path.stat().st_size
    buf = mmap.mmap(-1, PIECE)  # page aligned, as O_DIRECT wants

    def read(flags: int) -> Callable[[], None]:
        def run() -> None:
            fd = os.open(path, os.O_RDONLY | flags)
            try:
                while os.readv(fd, [buf]):
                    pass
            finally:
                os.close(fd)

        return run

    out = {"raw_read_buffered": size / best(read(0), 1, lambda: drop_caches(d)) / 1e9}
    try:
        direct = getattr(os, "O_DIRECT", 0)
        out["raw_read_direct"] = size / best(read(direct), 1, lambda: drop_caches(d)) / 1e9
    except OSError:
        pass  # no O_DIRECT on this filesystem
    return out


def tier_read_gbps(mem: Path) -> dict[str, float]:
    """The memory tier's floor: every chunk file of ``mem`` read (no hash, no placement) into
    one buffer by one thread per CPU, largest first, as the restore's readers do."""
    files = sorted(
        (p for p in (mem / "chunks").rglob("*") if p.is_file()), key=lambda p: -p.stat().st_size
    )
    sizes = [p.stat().st_size for p in files]
    buf = np.empty(sum(sizes), dtype=np.uint8)
    buf[:] = 0  # touched, like live tensors
    starts = np.cumsum([0, *sizes[:-1]]).tolist()
    view = memoryview(buf)

    def one(i: int) -> None:
        fd = os.open(files[i], os.O_RDONLY)
        try:
            at, end = starts[i], starts[i] + sizes[i]
            while at < end:
                at += os.readv(fd, [view[at : min(end, at + PIECE)]])
        finally:
            os.close(fd)

    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    with ThreadPoolExecutor(cpus or 1) as ex:
        t = best(lambda: list(ex.map(one, range(len(files)))), 1)
    return {"tier_read_all_threads": sum(sizes) / t / 1e9}


# -- flashckpt, interleaved with the limits it is compared to -----------------------------------
def rounds(
    state: dict[str, torch.Tensor], d: Path, shm: Path, repeats: int
) -> tuple[dict[str, float], dict[str, list[float]]]:
    """``repeats`` rounds, each measuring memcpy, a memory-tier restore, a cold raw read, a
    cold and a warm disk restore back to back (the machine's load moves between rounds, so
    each ratio is taken inside one round). Returns the best GB/s of each, and the ratios of
    every round."""
    nbytes = nbytes_of(state)
    root, mem = d / "flashckpt", shm / f"flashckpt-restore-bench-{os.getpid()}"
    no_mem = str(d / "no-memory-tier")  # a memory tier holding nothing: read the disk
    n = min(nbytes, 1 << 30)
    src = torch.empty(n, dtype=torch.uint8).fill_(1)
    dst = torch.empty(n, dtype=torch.uint8).fill_(2)
    raw = raw_file(d, nbytes)
    bests: dict[str, float] = {}
    per_round: dict[str, list[float]] = {}
    try:
        with flashckpt.Checkpointer(root, memory_tier=mem, keep_memory_after_close=True) as ck:
            ck.save(1, state).durable.result()
        live = {k: torch.zeros_like(v) for k, v in state.items()}  # touched, like a model

        def restore(**kw: Any) -> None:
            if flashckpt.restore(root, live, **kw) != 1:
                raise RuntimeError("flashckpt restore did not load step 1")

        for _ in range(repeats):
            r = memcpy_gbps(src, dst)
            r["flashckpt_memory"] = nbytes / best(restore, 1) / 1e9
            r.update(tier_read_gbps(mem))
            r.update(raw_read_gbps(raw, d))
            cold = nbytes / best(lambda: restore(memory_tier=no_mem), 1, lambda: drop_caches(d))
            r["flashckpt_disk_cold"] = cold / 1e9
            r["flashckpt_disk_warm"] = nbytes / best(lambda: restore(memory_tier=no_mem), 1) / 1e9
            for k, v in r.items():
                bests[k] = max(bests.get(k, 0.0), v)
            for k, v in ratios(r).items():
                per_round.setdefault(k, []).append(v)
        _check_equal(state, live, "flashckpt")
        return bests, per_round
    finally:
        raw.unlink()
        shutil.rmtree(mem, ignore_errors=True)
        shutil.rmtree(root, ignore_errors=True)


def _check_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], what: str) -> None:
    bad = [k for k in a if not torch.equal(a[k], b[k])]
    if bad:
        raise RuntimeError(f"{what} restored {len(bad)} tensors wrong, e.g. {bad[0]}")


# -- peers ---------------------------------------------------------------------------------------
def peer_gbps(state: dict[str, torch.Tensor], d: Path, shm: Path, repeats: int) -> dict[str, float]:
    import torch.distributed.checkpoint as dcp

    warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # no_dist=True
    nbytes = nbytes_of(state)
    live = {k: torch.zeros_like(v) for k, v in state.items()}  # touched, like a model
    out: dict[str, float] = {}
    for where, base, cold in (("memory", shm, False), ("disk_cold", d, True)):
        work = base / f"peers-restore-bench-{os.getpid()}"
        work.mkdir(parents=True)
        try:
            pt = work / "state.pt"
            torch.save(state, pt)
            writer = dcp.FileSystemWriter(str(work / "dcp"), sync_files=True)
            dcp.save(state, storage_writer=writer, no_dist=True)
            before = (lambda: drop_caches(d)) if cold else None

            def tload(mm: bool, pt: Path = pt) -> None:
                got = torch.load(pt, mmap=mm, weights_only=True)
                for k, v in live.items():
                    v.copy_(got[k])

            def dload(work: Path = work) -> None:
                reader = dcp.FileSystemReader(str(work / "dcp"))
                dcp.load(live, storage_reader=reader, no_dist=True)

            out[f"torch_load_{where}"] = nbytes / best(lambda: tload(False), repeats, before) / 1e9
            out[f"torch_load_mmap_{where}"] = (
                nbytes / best(lambda: tload(True), repeats, before) / 1e9
            )
            out[f"dcp_load_{where}"] = nbytes / best(dload, repeats, before) / 1e9
            _check_equal(state, live, f"dcp.load ({where})")
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return out


# -- report --------------------------------------------------------------------------------------
def machine() -> dict[str, Any]:
    commit = "unknown"
    try:
        here = Path(__file__).resolve().parent
        commit = subprocess.run(
            ["git", "-C", str(here), "describe", "--always", "--dirty"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        pass
    return {
        "commit": commit,
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
    }


def ratios(r: dict[str, float]) -> dict[str, float]:
    out = {}
    mem = r.get("flashckpt_memory")
    if mem:
        for k in (
            "memcpy_1_thread",
            "memcpy_all_threads",
            "memcpy_numpy_1_thread",
            "tier_read_all_threads",
        ):
            if r.get(k):
                out[f"memory_restore / {k}"] = mem / r[k]
    raw = max(r.get("raw_read_buffered", 0.0), r.get("raw_read_direct", 0.0))
    if raw and r.get("flashckpt_disk_cold"):
        out["disk_cold_restore / raw_read (best of buffered, O_DIRECT)"] = (
            r["flashckpt_disk_cold"] / raw
        )
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--size", default="1GiB", help="state size (default 1GiB)")
    ap.add_argument("--dir", default=None, help="a directory on the local disk (not tmpfs)")
    ap.add_argument("--shm", default="/dev/shm", help="where the memory tier goes")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--no-peers", action="store_true", help="skip torch.load and dcp.load")
    args = ap.parse_args(argv)
    size = parse_bytes(args.size, name="--size")
    load_start = os.getloadavg()
    state = llm_state(size)
    nbytes = nbytes_of(state)
    print(f"state: {len(state)} tensors, {format_bytes(nbytes)}; load average {load_start}")
    with tempfile.TemporaryDirectory(prefix="restore-bench-", dir=args.dir or os.getcwd()) as t:
        d, shm = Path(t), Path(args.shm)
        res, per_round = rounds(state, d, shm, args.repeats)
        if not args.no_peers:
            res.update(peer_gbps(state, d, shm, args.repeats))
        how = drop_caches(d)
    doc = {
        "machine": machine(),
        "state_bytes": nbytes,
        "tensors": len(state),
        "repeats": args.repeats,
        "cache_drop": how,
        "load_average_start": load_start,
        "load_average_end": os.getloadavg(),
        "gbps_best": res,
        "ratios_per_round": per_round,
        "ratios_median": {k: statistics.median(v) for k, v in per_round.items()},
    }
    print(f"{'what (best of rounds)':<28} GB/s")
    for k, v in res.items():
        print(f"{k:<28} {v:6.2f}")
    for k, v in per_round.items():
        rounds_txt = " ".join(f"{x:.2f}" for x in v)
        print(f"{k}: median {statistics.median(v):.2f} (rounds: {rounds_txt})")
    print(f"load average at the end {doc['load_average_end']}; commit {doc['machine']['commit']}")
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=2))
    return doc


if __name__ == "__main__":
    main()
