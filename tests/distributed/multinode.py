"""Simulated nodes on one machine: one ``torchrun --nnodes N --node-rank i`` per node, on loopback.

Each node is a separate torchrun invocation (its own process group of ``per_node`` ranks, its own
environment, e.g. its own memory-tier directory), so a whole node can be killed with one
``killpg`` and started again. Ranks run ``job(rank, world, node, **kwargs)`` -- ``job`` named as
``"module:function"`` of a module importable from ``tests/distributed`` -- inside an initialized
gloo process group; each rank's return value (JSON) or exception lands in ``<out>/rank-<r>.json``.

Usage from a test::

    cluster = Cluster(tmp_path, nodes=2, per_node=1, env=lambda i: {"MEM": f"{tmp}/n{i}"})
    results = cluster.run("replication_jobs:save_steps", steps=3)   # {rank: value}
    # or: cluster.start(...); cluster.kill_node(1); cluster.wait() ...

Run as a script, it is the per-rank entry point torchrun starts (``--job``, ``--kwargs``,
``--out``).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
SRC = HERE.parents[1] / "src"
NODE_TIER_ENV = "FLASHCKPT_TEST_NODE_TIER"  # the memory tier of the node a rank runs on


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Cluster:
    """``nodes`` simulated nodes of ``per_node`` ranks; ``env(i)``: extra variables of node i."""

    def __init__(
        self,
        tmp: Path,
        *,
        nodes: int,
        per_node: int = 1,
        env: Callable[[int], Mapping[str, str]] | None = None,
    ) -> None:
        self.tmp = Path(tmp)
        self.nodes = nodes
        self.per_node = per_node
        self.env = env or (lambda i: {})
        self.out = self.tmp / "results"
        self.procs: dict[int, subprocess.Popen[bytes]] = {}
        self.logs: dict[int, Path] = {}

    @property
    def world(self) -> int:
        return self.nodes * self.per_node

    def ranks_of(self, node: int) -> list[int]:
        return list(range(node * self.per_node, (node + 1) * self.per_node))

    def start(self, job: str, *, node_list: list[int] | None = None, **kwargs: Any) -> None:
        """Start every node (or ``node_list``) running ``job``; results go to ``self.out``."""
        self.out.mkdir(parents=True, exist_ok=True)
        port = free_port()
        args = self.tmp / f"kwargs-{port}.json"
        args.write_text(json.dumps(kwargs))
        for i in node_list if node_list is not None else range(self.nodes):
            self.procs[i] = self._start_node(i, job, args, port)

    def _start_node(self, i: int, job: str, args: Path, port: int) -> subprocess.Popen[bytes]:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([str(SRC), str(HERE), env.get("PYTHONPATH", "")])
        env["OMP_NUM_THREADS"] = "1"
        env.update(self.env(i))
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nnodes={self.nodes}",
            f"--node-rank={i}",
            f"--nproc-per-node={self.per_node}",
            "--master-addr=127.0.0.1",
            f"--master-port={port}",
            "--max-restarts=0",
            str(HERE / "multinode.py"),
            f"--job={job}",
            f"--kwargs={args}",
            f"--out={self.out}",
        ]
        for r in self.ranks_of(i):  # a stale pid must never be killed
            self.pid_file(r).unlink(missing_ok=True)
        self.logs[i] = self.tmp / f"node-{i}-{port}.log"
        log = open(self.logs[i], "wb")  # noqa: SIM115 - closed with the process
        try:
            return subprocess.Popen(
                cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        finally:
            log.close()

    def pid_file(self, rank: int) -> Path:
        """Where rank ``rank`` records its pid when it starts (before its job runs)."""
        return self.out / f"pid-{rank}"

    def kill_node(self, i: int, timeout_s: float = 30.0) -> None:
        """SIGKILL torchrun (its process group) and every rank of node ``i`` that recorded its
        pid: torchrun starts each rank in a session of its own, which ``killpg`` of torchrun's
        group does not reach. Returns when they are gone (or after ``timeout_s``)."""
        files = [self.pid_file(r) for r in self.ranks_of(i)]
        pids = [int(f.read_text()) for f in files if f.exists()]
        proc = self.procs[i]
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        for pid in pids:  # each rank leads a session of its own: the rank, then its children
            for kill in (os.kill, os.killpg):
                try:
                    kill(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
        proc.wait()
        deadline = time.monotonic() + timeout_s
        while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        for f in files:
            f.unlink(missing_ok=True)

    def wait(self, timeout_s: float = 120.0) -> dict[int, int | None]:
        """Wait for every started node; their exit codes (None: killed after ``timeout_s``)."""
        deadline = time.monotonic() + timeout_s
        codes: dict[int, int | None] = {}
        for i, proc in self.procs.items():
            try:
                codes[i] = proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.kill_node(i)
                codes[i] = None
        return codes

    def results(self) -> dict[int, Any]:
        """``{rank: value}`` of the ranks that wrote one (an exception: ``{"error": ...}``)."""
        out = {}
        for r in range(self.world):
            f = self.out / f"rank-{r}.json"
            if f.exists():
                out[r] = json.loads(f.read_text())
        return out

    def run(self, job: str, *, timeout_s: float = 120.0, **kwargs: Any) -> dict[int, Any]:
        """Start, wait, and return every rank's value; raise with the logs on any failure."""
        self.start(job, **kwargs)
        codes = self.wait(timeout_s)
        res = self.results()
        bad = [r for r in range(self.world) if r not in res or _failed(res[r])]
        if bad or any(c != 0 for c in codes.values()):
            raise AssertionError(f"ranks {bad} failed (exit codes {codes}):\n{self.tails()}")
        return res

    def tails(self, n: int = 4000) -> str:
        parts = []
        for r in range(self.world):
            f = self.out / f"rank-{r}.json"
            if f.exists() and _failed(json.loads(f.read_text())):
                parts.append(f"rank {r}: {json.loads(f.read_text())['tb'][-n:]}")
        for i, log in self.logs.items():
            text = log.read_text(errors="replace") if log.exists() else ""
            parts.append(f"--- node {i} log ---\n{text[-n:]}")
        return "\n".join(parts)


def _alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie, waiting for its reaper, counts as gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[-1].split()[0] != "Z"


def _failed(value: Any) -> bool:
    return isinstance(value, dict) and "error" in value and "tb" in value


def _main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--job", required=True)
    parser.add_argument("--kwargs", required=True)
    parser.add_argument("--out", required=True)
    a = parser.parse_args()
    pid = Path(a.out) / f"pid-{os.environ['RANK']}"  # Cluster.kill_node kills the ranks by these
    pid.with_suffix(".tmp").write_text(str(os.getpid()))
    pid.with_suffix(".tmp").rename(pid)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    node = int(os.environ.get("GROUP_RANK", "0"))
    out = Path(a.out) / f"rank-{rank}.json"
    try:
        mod, fn = a.job.split(":")
        kwargs = json.loads(Path(a.kwargs).read_text())
        value: Any = getattr(importlib.import_module(mod), fn)(rank, world, node, **kwargs)
    except BaseException as exc:
        value = {"error": type(exc).__name__, "message": str(exc), "tb": traceback.format_exc()}
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(value))
    tmp.rename(out)
    sys.stdout.flush()
    os._exit(0)  # skip destroying the groups: a dead peer node must not hang the exit


if __name__ == "__main__":
    _main()
