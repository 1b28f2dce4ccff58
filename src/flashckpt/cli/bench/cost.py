"""What a save costs a training loop (``flashckpt bench --parts loop-cost``,
``benchmarks/loop_cost.py``).

A 256 MiB state of 96 tensors (48 parameters and their SGD momentum buffers) is trained and
saved every ``every`` steps. The cost of a save is the loop's extra wall time per save against
no-save runs of the same loop measured right before and right after the method (their mean),
each run a fresh process. Three loop profiles:

* ``dispatch``: many small ops on one thread (what a GPU job's launcher thread does);
* ``compute``: matmuls on every core;
* ``contended``: ``compute`` with busy processes beside it (data-loader workers, another job),
  started before and stopped after each run, baselines included; the loop runs as many
  intra-op threads as the busy processes leave cores (at least one).

Methods: ``torch_save`` (+ fsync), ``dcp_thread`` and ``dcp_process`` (``dcp.async_save`` in its
two modes), ``flashckpt_disk`` and ``flashckpt_memory`` (async, with a memory tier in
/dev/shm). The physical floor, a memcpy of the same bytes (and of one save's changed bytes),
is measured in the same run. The first save of each fresh process is reported apart from the
warm ones (``first_s``, ``warm_s``).
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from flashckpt.demo.chaos_rounds import busy_load
from flashckpt.engine.runtime.hostcpu import run_queue_wait_s

PROFILES = ("dispatch", "compute", "contended")
METHODS = ("torch_save", "dcp_thread", "dcp_process", "flashckpt_disk", "flashckpt_memory")
MiB = 1 << 20


def _state(total_bytes: int, tensors: int) -> tuple[Any, Any]:
    import torch

    n_params = tensors // 2
    numel = total_bytes // 2 // n_params // 4
    g = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(numel, generator=g)) for _ in range(n_params)]
    for p in params:
        p.grad = torch.full_like(p, 1e-6)
    opt = torch.optim.SGD(params, lr=1e-3, momentum=0.9)
    opt.step()  # the momentum buffers exist from here on: 96 tensors
    return torch.nn.ParameterList(params), opt


def _work(profile: str) -> Any:
    import torch

    if profile == "dispatch":
        x = torch.zeros(8)

        def dispatch() -> None:
            y = x
            for _ in range(3000):
                y = y * 1.0001 + 0.0001

        return dispatch
    a, b = torch.randn(640, 640), torch.randn(640, 640)

    def compute() -> None:
        for _ in range(24):
            a.copy_(torch.tanh(a @ b) * 0.5)

    return compute


class _Method:
    """``save(step)`` for one method; ``finish()`` waits until the last save is durable."""

    def __init__(self, name: str, root: Path, model: Any, opt: Any) -> None:
        self.name, self.root, self.model, self.opt = name, root, model, opt
        self.pending: Any = None
        self.ck: Any = None
        self.mem: Path | None = None
        if name.startswith("flashckpt"):
            from flashckpt import Checkpointer

            if name == "flashckpt_memory":
                self.mem = Path("/dev/shm") / f"fc-cost-{os.getpid()}"
            self.ck = Checkpointer(root, async_save=True, keep=2, memory_tier=self.mem)
        if name == "dcp_process":  # its background process joins a process group of its own
            _one_rank_group()

    def save(self, step: int) -> None:
        import torch

        if self.ck is not None:
            self.ck.save(step, {"model": self.model, "optim": self.opt})
            return
        sd = {"model": self.model.state_dict(), "optim": self.opt.state_dict()}
        if self.name == "torch_save":
            path = self.root / f"{step}.pt"
            with open(path, "wb") as f:
                torch.save(sd, f)
                f.flush()
                os.fsync(f.fileno())
            return
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

        if self.pending is not None:
            self.pending.result()
        process = self.name == "dcp_process"
        kind = AsyncCheckpointerType.PROCESS if process else AsyncCheckpointerType.THREAD
        writer = dcp.FileSystemWriter(str(self.root / f"dcp{step}"), sync_files=True)
        self.pending = dcp.async_save(
            sd, storage_writer=writer, no_dist=not process, async_checkpointer_type=kind
        )

    def finish(self) -> None:
        if self.pending is not None:
            self.pending.result()
        if self.ck is not None:
            self.ck.close()
        if self.mem is not None:
            shutil.rmtree(self.mem, ignore_errors=True)


def _one_rank_group() -> None:
    import socket

    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1")
    dist.init_process_group("gloo", rank=0, world_size=1)


def _threads(profile: str, load: int) -> int:
    """Intra-op threads of a profile's loop: one for ``dispatch``, every core for ``compute``,
    and for ``contended`` the cores the busy processes leave (at least one). A team of as many
    threads as cores beside busy processes stalls at every barrier the moment one thread loses
    its core: its no-save runs took 12.6-38.9 s in one run, so no save's cost could be told
    from that spread; a job tuned for a shared host runs fewer threads."""
    cpus = os.cpu_count() or 1
    if profile == "dispatch":
        return 1
    if profile == "contended":
        return max(1, cpus - load)
    return cpus


def child(cfg: dict[str, Any]) -> dict[str, Any]:
    """One fresh process: ``cfg["method"]`` (or ``none``) in ``cfg["profile"]``'s loop."""
    import torch

    torch.set_num_threads(_threads(cfg["profile"], cfg.get("load", 0)))
    model, opt = _state(cfg["state_bytes"], cfg["tensors"])
    work = _work(cfg["profile"])
    root = Path(cfg["root"])
    root.mkdir(parents=True, exist_ok=True)
    method = None if cfg["method"] == "none" else _Method(cfg["method"], root, model, opt)
    for _ in range(3):  # warm the loop itself
        work()
        opt.step()
    times: list[float] = []
    waits: list[float] = []
    waited = run_queue_wait_s()
    t_start = time.perf_counter()
    for step in range(1, cfg["steps"] + 1):
        t0 = time.perf_counter()
        work()
        opt.step()
        every = cfg["every"]
        if method is not None and step % every == 0 and 2 * every <= step < cfg["steps"]:
            method.save(step)  # the steps before the first save are the run's own baseline
        times.append(time.perf_counter() - t0)
        now = run_queue_wait_s()
        if now is not None and waited is not None:
            waits.append(now - waited)
        waited = now
    wall = time.perf_counter() - t_start
    if method is not None:
        method.finish()
    return {"wall_s": wall, "steps_s": times, "waits_s": waits}


def _run_child(cfg: dict[str, Any]) -> dict[str, Any]:
    res = subprocess.run(
        [sys.executable, "-m", "flashckpt.cli.bench.cost", json.dumps(cfg)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    if res.returncode != 0:
        tail = (res.stderr or "").strip().splitlines()[-1:] or ["(no output)"]
        return {"error": tail[0][:300]}
    return dict(json.loads(res.stdout.strip().splitlines()[-1]))


def memcpy_s(nbytes: int, repeat: int = 5, pieces: int = 1) -> float:
    """The best of ``repeat`` copies of ``nbytes`` between two resident buffers (numpy), in
    ``pieces`` copies of equal size: one copy of the whole state is glibc's non-temporal
    memcpy where it is larger than its threshold (on the 2-core VM, which reports a 480 MiB
    L3: 256 MiB in 21 ms), while a copy per tensor (what any staging of separate tensors
    makes) stays under it and goes through the cache (37-39 ms)."""
    import numpy as np

    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    cuts = [nbytes * i // pieces for i in range(pieces + 1)]
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        for lo, hi in itertools.pairwise(cuts):
            np.copyto(dst[lo:hi], src[lo:hi])
        best = min(best, time.perf_counter() - t0)
    return best


def _per_save(run: dict[str, Any], base_wall: float, base_step: float, every: int) -> dict:
    """``cost_s``: the extra wall time per save against the no-save runs around this one;
    ``own_s``: each save's window of ``every`` steps against this run's own steps before its
    first save (immune to drift between processes); ``first_s`` and ``warm_s`` split that."""
    steps = run["steps_s"]
    saves = list(range(2 * every, len(steps), every))
    own = statistics.median(steps[: 2 * every - 1])
    windows = [sum(steps[s - 1 : s - 1 + every]) - every * own for s in saves]
    waits = run.get("waits_s") or []
    wait_s = None
    if len(waits) == len(steps):  # the training thread's run-queue wait, same windows
        quiet = statistics.median(waits[: 2 * every - 1])
        wait_s = statistics.mean(sum(waits[s - 1 : s - 1 + every]) - every * quiet for s in saves)
    return {
        "wait_s": wait_s,
        "cost_s": (run["wall_s"] - base_wall) / len(saves),
        "own_s": statistics.mean(windows),
        "first_s": windows[0],
        "warm_s": statistics.mean(windows[1:]) if len(windows) > 1 else windows[0],
        "saves": len(saves),
        "base_step_s": base_step,
        "own_step_s": own,
    }


def _over_rounds(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One method's rounds: the median of each number (the first error if every round failed);
    ``rounds_cost_s`` lists each round's cost per save."""
    ok = [r for r in runs if "error" not in r]
    if not ok:
        return runs[0] if runs else {"error": "not run"}
    out: dict[str, Any] = {
        k: statistics.median(r[k] for r in ok)
        for k in ("cost_s", "own_s", "first_s", "warm_s", "base_step_s", "own_step_s")
    }
    got = [r["wait_s"] for r in ok if r.get("wait_s") is not None]
    out["wait_s"] = statistics.median(got) if got else None
    out["saves"] = ok[0]["saves"]
    out["rounds_cost_s"] = [r["cost_s"] for r in ok]
    out["failed_rounds"] = len(runs) - len(ok)
    return out


def run(
    *,
    profiles: tuple[str, ...] = PROFILES,
    methods: tuple[str, ...] = METHODS,
    state_bytes: int = 256 * MiB,
    tensors: int = 96,
    steps: int = 70,
    every: int = 10,
    load: int = 2,
    rounds: int = 1,
    work_dir: str | None = None,
    say: Any = print,
) -> dict[str, Any]:
    """Every method in every profile, each run bracketed by no-save runs, ``rounds`` times in
    a rotating order (a busy host's drift then spreads over every method); a method's numbers
    are the medians over its rounds, with ``rounds_cost_s`` and their spread. One dict for
    JSON."""
    out: dict[str, Any] = {
        "state_bytes": state_bytes,
        "tensors": tensors,
        "steps": steps,
        "every": every,
        "rounds": rounds,
        "load": load,
        "cpus": os.cpu_count(),
        "memcpy_s": memcpy_s(state_bytes),
        "memcpy_per_tensor_s": memcpy_s(state_bytes, pieces=tensors),
        "profiles": {},
    }
    base_dir = Path(tempfile.mkdtemp(prefix="fc-cost-", dir=work_dir))
    try:
        for profile in profiles:
            res: dict[str, Any] = {"methods": {}, "baselines": []}
            with busy_load(load if profile == "contended" else 0):

                def one(method: str, i: int, profile: str = profile) -> dict[str, Any]:
                    root = base_dir / f"{profile}-{method}-{i}"
                    got = _run_child(
                        {
                            "profile": profile,
                            "method": method,
                            "root": str(root),
                            "state_bytes": state_bytes,
                            "tensors": tensors,
                            "steps": steps,
                            "every": every,
                            "load": load if profile == "contended" else 0,
                        }
                    )
                    shutil.rmtree(root, ignore_errors=True)
                    return got

                per: dict[str, list[dict[str, Any]]] = {m: [] for m in methods}
                i = 0
                before = one("none", i)
                res["baselines"].append(before["wall_s"])
                for r in range(rounds):  # the order rotates so no method always follows another
                    k = r % len(methods) if methods else 0
                    for method in methods[k:] + methods[:k]:
                        i += 1
                        got = one(method, i)
                        after = one("none", i)
                        res["baselines"].append(after["wall_s"])
                        if "error" in got:
                            per[method].append(got)
                            say(f"  {profile:9s} {method:17s} failed: {got['error']}")
                            before = after
                            continue
                        base_wall = (before["wall_s"] + after["wall_s"]) / 2
                        base_step = statistics.median(before["steps_s"] + after["steps_s"])
                        per[method].append(_per_save(got, base_wall, base_step, every))
                        ms = per[method][-1]["cost_s"] * 1e3
                        say(f"  {profile:9s} {method:17s} {ms:7.0f} ms/save (round {r + 1})")
                        before = after
                res["methods"] = {m: _over_rounds(runs) for m, runs in per.items()}
            out["profiles"][profile] = res
    finally:
        shutil.rmtree(base_dir, ignore_errors=True)
    return out


def table(result: dict[str, Any]) -> str:
    """The markdown table, each profile a row: ms per save against the no-save runs / against
    the run's own steps before its first save (in brackets: the first save, and ``waits``, the
    ms per save the training thread waited runnable for a CPU beyond its own quiet steps: what
    the save's threads took from it), and the memcpy floor."""
    methods = sorted({m for p in result["profiles"].values() for m in p["methods"]},
                     key=lambda m: METHODS.index(m) if m in METHODS else 99)  # fmt: skip
    head = "| profile | " + " | ".join(methods) + " | memcpy (whole / per tensor) |"
    rows = [head, "|---|" + "---:|" * (len(methods) + 1)]
    floor = f"{result['memcpy_s'] * 1e3:.0f}"
    if "memcpy_per_tensor_s" in result:
        floor += f" / {result['memcpy_per_tensor_s'] * 1e3:.0f}"
    for name, prof in result["profiles"].items():
        cells = []
        for m in methods:
            r = prof["methods"].get(m)
            if r is None or "error" in r:
                cells.append("failed" if r else "-")
            else:
                spread = ""
                if len(r.get("rounds_cost_s", [])) > 1:
                    lo, hi = min(r["rounds_cost_s"]), max(r["rounds_cost_s"])
                    spread = f" [{lo * 1e3:.0f}..{hi * 1e3:.0f}]"
                wait = r.get("wait_s")
                waited = "" if wait is None else f"; waits {wait * 1e3:.0f}"
                cells.append(
                    f"{r['cost_s'] * 1e3:.0f}{spread} / {r['own_s'] * 1e3:.0f} ms "
                    f"(first {r['first_s'] * 1e3:.0f}{waited})"
                )
        rows.append(f"| {name} | " + " | ".join(cells) + f" | {floor} ms |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(json.dumps(child(json.loads(sys.argv[1]))))
