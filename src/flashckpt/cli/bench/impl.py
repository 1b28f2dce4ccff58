"""The save benchmark behind ``flashckpt bench`` and ``benchmarks/save_bench.py``.

Every method saves the *same* state (an MLP's fp32 parameters plus AdamW's two moments, after
one step) into a fresh directory, and every method fsyncs what it writes. Each measurement is
repeated and the median reported; the page cache is dropped before each one when the kernel
lets us (``/proc/sys/vm/drop_caches``). Times:

* ``blocking_s``: how long the training thread cannot touch the state (the call, plus the wait
  until the snapshot is safe, with no computation to overlap);
* ``returned_s``: how long the call itself took (flashckpt async returns before staging when the
  state holds an optimizer: the next ``optimizer.step()`` waits instead);
* ``durable_s``: from the call until everything is on disk.
"""

from __future__ import annotations

import logging
import os
import shutil
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from flashckpt.engine.runtime.checkpointer import Checkpointer

log = logging.getLogger(__name__)

GB = 1e9
WRITE_PIECE = 64 << 20


@dataclass(frozen=True, kw_only=True)
class SaveBenchConfig:
    size_bytes: int
    root: Path
    repeats: int = 3
    device: str = "cpu"
    drop_caches: bool = True


@dataclass(kw_only=True)
class Sample:
    blocking_s: float
    durable_s: float
    returned_s: float | None = None
    extra: dict[str, float] = field(default_factory=dict)


@dataclass(kw_only=True)
class Bench:
    """The state under test and where methods write."""

    model: nn.Module
    opt: torch.optim.Optimizer
    root: Path
    device: str
    nbytes: int
    caches_dropped: bool = True
    drop: bool = True  # drop the page cache before each measurement
    keep: dict[str, Any] = field(default_factory=dict)  # per-method objects kept across repeats

    def fresh_dir(self, name: str) -> Path:
        path = self.root / name
        shutil.rmtree(path, ignore_errors=True)
        path.mkdir(parents=True)
        return path

    def state_dict(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "optim": self.opt.state_dict()}

    def live_state(self) -> dict[str, Any]:
        return {"model": self.model, "optim": self.opt}


# -- the state --------------------------------------------------------------------------------
def build_state(size_bytes: int, device: str = "cpu", *, seed: int = 0) -> tuple[nn.Module, Any]:
    """An MLP whose params + AdamW moments take about ``size_bytes``, after one AdamW step."""
    torch.manual_seed(seed)
    width = 2048 if size_bytes >= 256 << 20 else 512
    per_layer = (width * width + width) * 4 * 3
    layers = max(1, round(size_bytes / per_layer))
    model = nn.Sequential(*[nn.Linear(width, width, device=device) for _ in range(layers)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(4, width, device=device)
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return model, opt


def state_nbytes(model: nn.Module, opt: torch.optim.Optimizer) -> int:
    n = sum(p.numel() * p.element_size() for p in model.parameters())
    for st in opt.state.values():
        n += sum(v.numel() * v.element_size() for v in st.values() if isinstance(v, torch.Tensor))
    return n


def state_tensors(model: nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    out = [p.detach() for p in model.parameters()]
    for st in opt.state.values():
        out.extend(v for v in st.values() if isinstance(v, torch.Tensor))
    return out


# -- helpers ----------------------------------------------------------------------------------
def drop_caches() -> bool:
    """Write back and drop the page cache; False when the kernel does not let us."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(path: Path) -> None:
    """fsync every directory under ``path`` (files are fsynced by whoever wrote them)."""
    for dirpath, _dirs, _files in os.walk(path):
        fsync_dir(Path(dirpath))


def write_all(fd: int, data: memoryview) -> None:
    for start in range(0, len(data), WRITE_PIECE):
        mv = data[start : start + WRITE_PIECE]
        while mv:
            mv = mv[os.write(fd, mv) :]


@contextmanager
def timer() -> Iterator[list[float]]:
    out: list[float] = []
    t0 = time.perf_counter()
    yield out
    out.append(time.perf_counter() - t0)


# -- the methods ------------------------------------------------------------------------------
def m_raw(b: Bench) -> Sample:
    """The device: the same bytes, one file, sequential writes, one fsync."""
    host = b.keep.get("raw_host")
    if host is None:
        host = [t.detach().cpu().contiguous().reshape(-1).view(torch.uint8) for t in b.keep["ts"]]
        b.keep["raw_host"] = host
    path = b.fresh_dir("raw")
    t0 = time.perf_counter()
    fd = os.open(path / "state.bin", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for t in host:
            write_all(fd, memoryview(t.numpy()))
        os.fsync(fd)
    finally:
        os.close(fd)
    fsync_dir(path)
    t = time.perf_counter() - t0
    return Sample(blocking_s=t, durable_s=t)


def m_d2h(b: Bench) -> Sample:
    """CUDA only: one copy of every tensor into a preallocated pinned host buffer."""
    ts = b.keep["ts"]
    host = b.keep.get("d2h_host")
    if host is None:
        host = b.keep["d2h_host"] = torch.empty(b.nbytes, dtype=torch.uint8, pin_memory=True)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    pos = 0
    for t in ts:
        flat = t.detach().reshape(-1).view(torch.uint8)
        host[pos : pos + flat.numel()].copy_(flat, non_blocking=True)
        pos += flat.numel()
    torch.cuda.synchronize()
    t = time.perf_counter() - t0
    return Sample(blocking_s=t, durable_s=t)


def m_torch_save(b: Bench) -> Sample:
    path = b.fresh_dir("torch_save")
    t0 = time.perf_counter()
    with open(path / "ckpt.pt", "wb") as f:
        torch.save(b.state_dict(), f)
        f.flush()
        os.fsync(f.fileno())
    fsync_dir(path)
    t = time.perf_counter() - t0
    return Sample(blocking_s=t, durable_s=t)


def m_dcp_save(b: Bench) -> Sample:
    import torch.distributed.checkpoint as dcp

    path = b.fresh_dir("dcp_save")
    t0 = time.perf_counter()
    writer = dcp.FileSystemWriter(str(path), sync_files=True)
    dcp.save(b.state_dict(), storage_writer=writer, no_dist=True)
    fsync_tree(path)
    t = time.perf_counter() - t0
    return Sample(blocking_s=t, durable_s=t)


def m_dcp_async(b: Bench) -> Sample:
    """``dcp.async_save`` with its default stager (synchronous copy to fresh CPU memory)."""
    import torch.distributed.checkpoint as dcp

    path = b.fresh_dir("dcp_async")
    t0 = time.perf_counter()
    writer = dcp.FileSystemWriter(str(path), sync_files=True)
    fut: Any = dcp.async_save(b.state_dict(), storage_writer=writer, no_dist=True)
    returned = time.perf_counter() - t0
    staged = returned
    if hasattr(fut, "staging_completion"):
        fut.staging_completion.result()
        staged = time.perf_counter() - t0
        fut = fut.upload_completion
    fut.result()
    fsync_tree(path)
    return Sample(blocking_s=staged, returned_s=returned, durable_s=time.perf_counter() - t0)


def m_dcp_async_stager(b: Bench) -> Sample:
    """``dcp.async_save`` with a kept ``DefaultStager``: staging in a thread into cached
    shared-memory buffers (pinned and non-blocking when CUDA is there)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    stager = b.keep.get("dcp_stager")
    if stager is None:
        cuda = b.device.startswith("cuda")
        opts = StagingOptions(
            use_pinned_memory=cuda,
            use_shared_memory=True,
            use_async_staging=True,
            use_non_blocking_copy=cuda,
        )
        stager = b.keep["dcp_stager"] = DefaultStager(opts)
    path = b.fresh_dir("dcp_async_stager")
    t0 = time.perf_counter()
    writer = dcp.FileSystemWriter(str(path), sync_files=True)
    resp: Any = dcp.async_save(
        b.state_dict(), storage_writer=writer, no_dist=True, async_stager=stager
    )
    returned = time.perf_counter() - t0
    resp.staging_completion.result()
    staged = time.perf_counter() - t0
    resp.upload_completion.result()
    fsync_tree(path)
    return Sample(blocking_s=staged, returned_s=returned, durable_s=time.perf_counter() - t0)


def m_flash_sync(b: Bench) -> Sample:
    path = b.fresh_dir("flash_sync")
    with Checkpointer(path, async_save=False, incremental=False) as ck:
        t0 = time.perf_counter()
        ck.save(0, b.live_state())
        t = time.perf_counter() - t0
    return Sample(blocking_s=t, durable_s=t)


def _flash_async(b: Bench, name: str, *, incremental: bool) -> Sample:
    ck = b.keep.get(name)
    if ck is None:
        ck = b.keep[name] = Checkpointer(
            b.fresh_dir(name), async_save=True, incremental=incremental, keep=1
        )
    step = b.keep[name + "_step"] = b.keep.get(name + "_step", 0) + 1
    t0 = time.perf_counter()
    handle = ck.save(step, b.live_state())
    returned = time.perf_counter() - t0
    handle.staged.result()
    staged = time.perf_counter() - t0
    stats = handle.durable.result()
    durable = time.perf_counter() - t0
    extra = {"new_bytes": float(stats.new_bytes), "reused_bytes": float(stats.reused_bytes)}
    return Sample(blocking_s=staged, returned_s=returned, durable_s=durable, extra=extra)


def m_flash_async(b: Bench) -> Sample:
    """Full async saves (incremental off), one Checkpointer kept: its staging pool is warm."""
    return _flash_async(b, "flash_async", incremental=False)


def m_flash_incremental(b: Bench) -> Sample:
    """Async re-save of the unchanged state (the first, full save is the warm-up)."""
    return _flash_async(b, "flash_incremental", incremental=True)


Method = Callable[[Bench], Sample]
METHODS: dict[str, Method] = {
    "raw_write": m_raw,
    "torch_save": m_torch_save,
    "dcp_save": m_dcp_save,
    "dcp_async_save": m_dcp_async,
    "dcp_async_save_stager": m_dcp_async_stager,
    "flashckpt_sync": m_flash_sync,
    "flashckpt_async": m_flash_async,
    "flashckpt_incremental": m_flash_incremental,
}
CUDA_METHODS: dict[str, Method] = {"d2h_copy": m_d2h}
WARMUP = ("d2h_copy", "dcp_async_save_stager", "flashckpt_async", "flashckpt_incremental")


def measure(b: Bench, name: str, repeats: int) -> dict[str, Any]:
    """Median of ``repeats`` samples of one method (plus one unrecorded warm-up for methods
    that keep state between saves)."""
    fn = METHODS.get(name) or CUDA_METHODS[name]
    if name in WARMUP:
        b.caches_dropped &= drop_caches() if b.drop else False
        fn(b)
    samples = []
    for _ in range(repeats):
        b.caches_dropped &= drop_caches() if b.drop else False
        samples.append(fn(b))
    out: dict[str, Any] = {
        "blocking_s": statistics.median(s.blocking_s for s in samples),
        "durable_s": statistics.median(s.durable_s for s in samples),
        "min_blocking_s": min(s.blocking_s for s in samples),
        "min_durable_s": min(s.durable_s for s in samples),
        "samples_durable_s": [round(s.durable_s, 4) for s in samples],
    }
    if samples[0].returned_s is not None:
        out["returned_s"] = statistics.median(s.returned_s or 0.0 for s in samples)
    for key in samples[0].extra:
        out[key] = statistics.median(s.extra[key] for s in samples)
    log.info("%s: %s", name, out)
    return out


def run_save_bench(cfg: SaveBenchConfig) -> dict[str, Any]:
    model, opt = build_state(cfg.size_bytes, cfg.device)
    b = Bench(
        model=model, opt=opt, root=cfg.root, device=cfg.device, nbytes=0, drop=cfg.drop_caches
    )
    b.nbytes = state_nbytes(model, opt)
    b.keep["ts"] = state_tensors(model, opt)
    results: dict[str, Any] = {}
    names = list(METHODS)
    if cfg.device.startswith("cuda"):
        names.insert(0, "d2h_copy")
    try:
        for name in names:
            try:
                results[name] = measure(b, name, cfg.repeats)
            except Exception as exc:  # a peer missing or broken in this torch: report, go on
                log.warning("bench method %s failed: %s", name, exc)
                results[name] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
            if name not in WARMUP:
                shutil.rmtree(cfg.root / name, ignore_errors=True)
    finally:
        for obj in b.keep.values():
            close = getattr(obj, "close", None)
            if close is not None:
                close()
    return {
        "state_bytes": b.nbytes,
        "device": cfg.device,
        "repeats": cfg.repeats,
        "caches_dropped": b.caches_dropped,
        "methods": results,
    }
