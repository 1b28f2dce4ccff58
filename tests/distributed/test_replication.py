"""Peer replication across simulated nodes: one torchrun per node on loopback
(:mod:`multinode`), each node with its own memory-tier directory."""

from __future__ import annotations

import os
import shutil
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from multinode import NODE_TIER_ENV, Cluster

from flashckpt.distributed.replication.record import replicated_steps
from flashckpt.journal import read_events
from flashckpt.store.files.backend import LocalBackend
from flashckpt.store.store import CheckpointStore

pytestmark = [pytest.mark.dist, pytest.mark.slow]  # a torchrun per node: ~40 s each here


@pytest.fixture
def shm(tmp_path: Path) -> Iterator[Path]:
    base = Path("/dev/shm")
    d = base / f"flashckpt-repl-{uuid.uuid4().hex[:12]}" if base.is_dir() else tmp_path / "shm"
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _model(seed: int) -> Any:
    import torch
    from torch import nn

    torch.manual_seed(seed)  # each weight (600x512 fp32, >1MiB) is a chunk of its own
    return nn.Sequential(*[nn.Linear(512, 600) for _ in range(4)])


def _open(root: str, **kw: Any) -> Any:
    from flashckpt import Checkpointer
    from flashckpt.engine.options import Replication

    rep = Replication(timeout_s=kw.pop("timeout_s", 30))
    mem = os.environ[NODE_TIER_ENV]
    return Checkpointer(root, memory_tier=mem, replicas=rep, fsync=False, dist_timeout_s=30, **kw)


def save_steps(rank: int, world: int, node: int, root: str, steps: list[int]) -> dict[str, Any]:
    """Save ``steps`` with replicas=1 into this node's memory tier (``NODE_TIER_ENV``), one
    weight changing per step, each replicated before the next save."""
    import torch

    model = _model(0)
    # the test reads the node tiers after close: keep them (a clean close empties them)
    with _open(root, keep_memory=2, keep_memory_after_close=True) as ck:
        for step in steps:
            with torch.no_grad():
                model[step % 4].weight.add_(1.0)
            ck.save(step, {"model": model})
            ck._dist.replicator.drain()
        nodes = ck._dist.nodes
        sent = {r.step: r.sent_bytes for r in ck._dist.replicator.history}
    return {"node": node, "label": nodes.node_of(rank), "peer": nodes.peer_of(rank), "sent": sent}


@pytest.mark.parametrize("per_node", [1, 2])
def test_torchrun_nodes_replicate_to_their_peers(tmp_path: Path, shm: Path, per_node: int) -> None:
    cluster = Cluster(
        tmp_path, nodes=2, per_node=per_node, env=lambda i: {NODE_TIER_ENV: f"{shm}/n{i}"}
    )
    root = tmp_path / "ckpt"
    res = cluster.run("test_replication:save_steps", root=str(root), steps=[1, 2, 3])
    assert [res[r]["label"] for r in range(cluster.world)] == [
        f"node-{r // per_node}" for r in range(cluster.world)
    ], "nodes from torchrun's GROUP_RANK"
    assert all(res[r]["peer"] == (r + per_node) % cluster.world for r in res)
    stores = [CheckpointStore(LocalBackend(shm / f"n{i}")) for i in (0, 1)]
    m3 = stores[0].load_manifest(3)
    for i, store in enumerate(stores):
        assert store.steps() == [2, 3]
        assert {c.hash for c in m3.chunks} <= set(store.liveness.index()), f"node {i}"
        assert replicated_steps(shm / f"n{i}") == {2, 3}
    chunk = 600 * 512 * 4
    assert sum(res[r]["sent"]["2"] for r in res) == chunk, "only the changed weight is sent"
    assert 3 in CheckpointStore(LocalBackend(root)).steps()


def dying_peer(rank: int, world: int, node: int, root: str, marker: str) -> dict[str, Any]:
    """Node 1 stalls in step 2's replication round (the test then kills it); node 0 waits for
    its replicator to give up."""
    import time

    import torch

    from flashckpt.distributed.replication import transfer

    real = transfer.Exchange.chunks
    calls = {"n": 0}

    def chunks(self: Any, *a: Any) -> int:
        calls["n"] += 1
        if node == 1 and calls["n"] == 2:
            Path(marker).touch()
            time.sleep(120)
        return real(self, *a)

    transfer.Exchange.chunks = chunks  # type: ignore[method-assign]
    model = _model(0)
    ck = _open(root, timeout_s=3)
    for step in (1, 2):
        with torch.no_grad():
            model[step].weight.add_(1.0)
        ck.save(step, {"model": model})
        if step == 1:
            ck._dist.replicator.drain()
    deadline = time.monotonic() + 60
    while ck._dist.replicator.broken is None and time.monotonic() < deadline:
        time.sleep(0.2)
    broken = ck._dist.replicator.broken
    return {"broken": broken, "suspended": ck._tiers.by_name("memory").suspended is not None}


def test_a_peer_node_killed_mid_replication_is_journaled_and_not_marked(
    tmp_path: Path, shm: Path
) -> None:
    cluster = Cluster(tmp_path, nodes=2, per_node=1, env=lambda i: {NODE_TIER_ENV: f"{shm}/n{i}"})
    root, marker = tmp_path / "ckpt", tmp_path / "stalled"
    cluster.start("test_replication:dying_peer", root=str(root), marker=str(marker))
    deadline = time.monotonic() + 120
    while not marker.exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert marker.exists(), cluster.tails()
    cluster.kill_node(1)
    cluster.wait(90)
    res = cluster.results()
    assert res.get(0, {}).get("broken"), cluster.tails()
    assert res[0]["suspended"], "later saves go to the disk tier"
    assert replicated_steps(shm / "n0") == {1}, "step 2 is not marked replicated"
    failed = [e for e in read_events(root) if e["event"] == "replication_failed"]
    assert failed and failed[0]["step"] == 2 and failed[0]["stopped"], failed
