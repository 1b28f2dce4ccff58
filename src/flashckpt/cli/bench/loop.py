"""Benchmarks that need a running loop: training with checkpoints, the GIL probe, RSS over saves.

* ``run_loop_bench``: step time of the demo GPT with no checkpoints vs a checkpoint every k
  steps with each method; reports the extra loop time per save.
* ``run_gil_probe``: how much a Python-heavy training thread slows down while checkpoint bytes
  are hashed, written and fsynced in background *threads* vs in a separate *process* reading
  shared memory (the choice DESIGN.md asks to make by measurement), and during a real flashckpt
  async save.
* ``run_rss_series``: host RSS after each of many async saves of a changing state.
"""

from __future__ import annotations

import logging
import os
import shutil
import statistics
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import xxhash

from flashckpt.cli.bench.impl import build_state, fsync_dir, state_nbytes, write_all
from flashckpt.demo.model import GPT, GPTConfig
from flashckpt.engine.runtime.checkpointer import Checkpointer

log = logging.getLogger(__name__)

PROBE_CHUNK = 32 << 20


@dataclass(frozen=True, kw_only=True)
class LoopConfig:
    root: Path
    device: str = "cpu"
    steps: int = 30
    every: int = 5
    n_embd: int = 256
    n_head: int = 4
    n_layer: int = 4
    batch: int = 8
    block: int = 128
    threads: int = 1  # intra-op threads of the training thread on CPU
    rounds: int = 1  # each round runs every method once, between two runs without checkpoints


# -- training loop ----------------------------------------------------------------------------
def _train_step(
    model: GPT, opt: torch.optim.Optimizer, cfg: LoopConfig, g: torch.Generator
) -> None:
    vocab = model.config.vocab_size
    idx = torch.randint(vocab, (cfg.batch, cfg.block + 1), generator=g).to(cfg.device)
    loss = model(idx[:, :-1], idx[:, 1:])[1]
    opt.zero_grad(set_to_none=True)
    loss.backward()  # type: ignore[union-attr]
    opt.step()
    loss.item()  # type: ignore[union-attr]  # a host sync: step times are real on CUDA too


class _Saver:
    """One checkpoint method inside the loop: ``save(step)`` then ``finish()``."""

    def __init__(self, name: str, root: Path, model: GPT, opt: torch.optim.Optimizer) -> None:
        self.name, self.root, self.model, self.opt = name, root, model, opt
        self.call_s: list[float] = []
        self._pending: Any = None
        self._ck: Checkpointer | None = None
        if name == "flashckpt_async":
            self._ck = Checkpointer(root / name, async_save=True, keep=2)

    def _sd(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "optim": self.opt.state_dict()}

    def save(self, step: int) -> None:
        t0 = time.perf_counter()
        if self.name == "torch_save":
            path = self.root / f"torch_save_{step}.pt"
            with open(path, "wb") as f:
                torch.save(self._sd(), f)
                f.flush()
                os.fsync(f.fileno())
            fsync_dir(self.root)
        elif self.name == "dcp_async_save":
            import torch.distributed.checkpoint as dcp

            if self._pending is not None:
                self._pending.result()
            writer = dcp.FileSystemWriter(str(self.root / f"dcp_{step}"), sync_files=True)
            self._pending = dcp.async_save(self._sd(), storage_writer=writer, no_dist=True)
        elif self._ck is not None:
            self._ck.save(step, {"model": self.model, "optim": self.opt})
        self.call_s.append(time.perf_counter() - t0)

    def finish(self) -> None:
        if self._pending is not None:
            self._pending.result()
        if self._ck is not None:
            self._ck.close()


def _loop(cfg: LoopConfig, model: GPT, opt: Any, method: str) -> dict[str, Any]:
    root = cfg.root / f"loop_{method}"
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    saver = None if method == "none" else _Saver(method, root, model, opt)
    g = torch.Generator().manual_seed(1)
    step_s: list[float] = []
    t0, c0 = time.perf_counter(), time.process_time()
    for step in range(1, cfg.steps + 1):
        ts = time.perf_counter()
        _train_step(model, opt, cfg, g)
        if saver is not None and step % cfg.every == 0:
            saver.save(step)
        step_s.append(time.perf_counter() - ts)
    loop_s = time.perf_counter() - t0
    cpu_s = time.process_time() - c0  # every thread of this process: training and saving
    tail_s = 0.0
    if saver is not None:
        tf = time.perf_counter()
        saver.finish()
        tail_s = time.perf_counter() - tf
    shutil.rmtree(root, ignore_errors=True)
    out: dict[str, Any] = {
        "loop_s": loop_s,
        "cpu_s": cpu_s,
        "mean_step_s": statistics.fmean(step_s),
        "median_step_s": statistics.median(step_s),
        "saves": cfg.steps // cfg.every if saver is not None else 0,
        "final_wait_s": tail_s,
    }
    if saver is not None:
        out["mean_call_s"] = statistics.fmean(saver.call_s)
    return out


def run_loop_bench(cfg: LoopConfig) -> dict[str, Any]:
    """On CPU the training thread uses ``cfg.threads`` intra-op threads (default 1: with two
    OpenMP threads on a busy 2-core host a step took 4x longer and varied wildly)."""
    threads = torch.get_num_threads()
    if cfg.device == "cpu":
        torch.set_num_threads(cfg.threads)
    try:
        return _run_loop_bench(cfg)
    finally:
        torch.set_num_threads(threads)


def _run_loop_bench(cfg: LoopConfig) -> dict[str, Any]:
    torch.manual_seed(0)
    gcfg = GPTConfig(
        vocab_size=96,
        block_size=cfg.block,
        n_layer=cfg.n_layer,
        n_head=cfg.n_head,
        n_embd=cfg.n_embd,
    )
    model = GPT(gcfg).to(cfg.device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(0)
    for _ in range(3):  # warm-up: optimizer state exists, allocator settled
        _train_step(model, opt, cfg, g)
    # Rounds interleave the methods with runs without checkpoints, and each method is compared
    # with the two baseline runs around it: the shared machine drifts by more than the effect.
    methods = ["torch_save", "dcp_async_save", "flashckpt_async"]
    base_runs = [_loop(cfg, model, opt, "none")]
    by_method: dict[str, list[dict[str, Any]]] = {m: [] for m in methods}
    for _ in range(cfg.rounds):
        for method in methods:
            by_method[method].append(_loop(cfg, model, opt, method))
        base_runs.append(_loop(cfg, model, opt, "none"))
    med = statistics.median
    out_methods: dict[str, Any] = {
        "none": {k: med(r[k] for r in base_runs) for k in ("loop_s", "cpu_s", "mean_step_s")}
    }
    for method, rs in by_method.items():
        extra, extra_cpu = [], []
        for i, r in enumerate(rs):
            around = base_runs[i : i + 2]
            extra.append((r["loop_s"] - statistics.fmean(b["loop_s"] for b in around)) / r["saves"])
            extra_cpu.append(
                (r["cpu_s"] - statistics.fmean(b["cpu_s"] for b in around)) / r["saves"]
            )
        out_methods[method] = {
            **{k: med(r[k] for r in rs) for k in ("loop_s", "cpu_s", "mean_step_s", "mean_call_s")},
            "saves": rs[0]["saves"],
            "extra_per_save_s": med(extra),
            "extra_per_save_runs_s": extra,
            "extra_cpu_per_save_s": med(extra_cpu),
            "slowdown": med(r["loop_s"] for r in rs) / out_methods["none"]["loop_s"] - 1.0,
        }
    return {
        "state_bytes": state_nbytes(model, opt),
        "device": cfg.device,
        "steps": cfg.steps,
        "every": cfg.every,
        "torch_threads": cfg.threads if cfg.device == "cpu" else torch.get_num_threads(),
        "rounds": cfg.rounds,
        "baseline_runs_s": [r["loop_s"] for r in base_runs],
        "methods": out_methods,
    }


# -- GIL probe: persist in threads vs in a process --------------------------------------------
def _python_heavy(seconds: float, busy: Callable[[], bool] | None = None) -> float:
    """Iterations per second of a loop of small tensor ops and Python arithmetic (what a
    training thread looks like when it is dispatch-bound), while ``busy()`` holds."""
    x = torch.zeros(16)
    n, t0 = 0, time.perf_counter()
    while True:
        for _ in range(200):
            x = x * 1.0001 + 0.5
            n += 1
        dt = time.perf_counter() - t0
        if (busy is None and dt >= seconds) or (busy is not None and not busy()):
            return n / dt


def _persist_work(chunks: list[Any], root: Path, workers: int) -> None:
    """What a persist worker does with staged bytes: hash, write, fsync."""

    def one(i: int) -> None:
        h = xxhash.xxh3_128(chunks[i]).hexdigest()
        fd = os.open(root / h, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            write_all(fd, memoryview(chunks[i]))
            os.fsync(fd)
        finally:
            os.close(fd)

    with ThreadPoolExecutor(workers) as ex:
        list(ex.map(one, range(len(chunks))))
    fsync_dir(root)


def _child(shared: torch.Tensor, root: str, workers: int, ready: Any, go: Any) -> None:
    arr = shared.numpy()
    chunks = [arr[i : i + PROBE_CHUNK] for i in range(0, arr.size, PROBE_CHUNK)]
    ready.set()
    go.wait()
    _persist_work(chunks, Path(root), workers)


def _fresh(root: Path) -> Path:
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    return root


def run_gil_probe(
    root: Path, nbytes: int, *, workers: int = 4, alone_s: float = 1.5
) -> dict[str, Any]:
    import torch.multiprocessing as mp

    shared = torch.randint(0, 255, (nbytes,), dtype=torch.uint8).share_memory_()
    arr = shared.numpy()
    chunks = [arr[i : i + PROBE_CHUNK] for i in range(0, arr.size, PROBE_CHUNK)]
    alone = _python_heavy(alone_s)
    # threads in this process
    with ThreadPoolExecutor(1) as ex:
        fut = ex.submit(_persist_work, chunks, _fresh(root / "threads"), workers)
        t0 = time.perf_counter()
        in_threads = _python_heavy(0, busy=lambda: not fut.done())
        threads_s = time.perf_counter() - t0
        fut.result()
    # a separate process reading the same shared memory
    ctx = mp.get_context("spawn")
    ready, go = ctx.Event(), ctx.Event()
    proc = ctx.Process(target=_child, args=(shared, str(_fresh(root / "proc")), workers, ready, go))
    proc.start()
    ready.wait(120)
    go.set()
    t0 = time.perf_counter()
    in_process = _python_heavy(0, busy=proc.is_alive)
    process_s = time.perf_counter() - t0
    proc.join()
    # the real engine: one async save of the same bytes (staging + persist threads)
    with Checkpointer(_fresh(root / "flash"), async_save=True, incremental=False) as ck:
        t0 = time.perf_counter()
        handle = ck.save(0, {f"t{i}": torch.from_numpy(c) for i, c in enumerate(chunks)})
        in_flash = _python_heavy(0, busy=lambda: not handle.done())
        flash_s = time.perf_counter() - t0
    shutil.rmtree(root, ignore_errors=True)
    return {
        "bytes": nbytes,
        "workers": workers,
        "alone_it_per_s": alone,
        "threads_it_per_s": in_threads,
        "process_it_per_s": in_process,
        "flashckpt_it_per_s": in_flash,
        "threads_slowdown": 1 - in_threads / alone,
        "process_slowdown": 1 - in_process / alone,
        "flashckpt_slowdown": 1 - in_flash / alone,
        "threads_persist_s": threads_s,
        "process_persist_s": process_s,
        "flashckpt_save_s": flash_s,
        "threads_lost_s": threads_s * (1 - in_threads / alone),
        "process_lost_s": process_s * (1 - in_process / alone),
        "flashckpt_lost_s": flash_s * (1 - in_flash / alone),
        "process_exitcode": proc.exitcode,
    }


# -- RSS over saves ---------------------------------------------------------------------------
def vm_rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise OSError("no VmRSS in /proc/self/status")


def run_rss_series(root: Path, nbytes: int, *, saves: int = 40, device: str = "cpu") -> dict:
    """RSS after each of ``saves`` async saves, one training step (every chunk changes) between."""
    model, opt = build_state(nbytes, device)
    width = next(model.parameters()).shape[1]
    rss: list[int] = []
    with Checkpointer(_fresh(root), async_save=True, keep=2) as ck:
        for step in range(saves):
            ck.save(step, {"model": model, "optim": opt})
            x = torch.randn(4, width, device=device)
            model(x).square().mean().backward()
            opt.step()  # waits for staging (optimizer hook)
            opt.zero_grad(set_to_none=True)
            ck.wait()
            rss.append(vm_rss_bytes())
    shutil.rmtree(root, ignore_errors=True)
    warm = statistics.median(rss[2:6])
    growth = max(rss[6:]) - warm
    return {
        "state_bytes": state_nbytes(model, opt),
        "saves": saves,
        "rss_bytes": rss,
        "warm_rss_bytes": warm,
        "growth_after_warmup_bytes": growth,
        "growth_vs_state": growth / state_nbytes(model, opt),
    }
