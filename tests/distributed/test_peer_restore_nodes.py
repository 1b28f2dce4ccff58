"""A whole node lost, with real processes: one torchrun per simulated node on loopback
(:mod:`multinode`), each node with its own memory-tier directory. The job saves with
``replicas=1``; every process of node 1 is SIGKILLed (``Cluster.kill_node``) and its memory
tier deleted (the survivors are killed too: the job restarts); a replacement node 1 starts with
an empty memory tier and the job restores the newest step from its peer, with the disk tier's
``chunks/`` hidden (any disk read fails), bitwise equal to what was saved. Both tiers gone: the
disk, still bitwise."""

from __future__ import annotations

import os
import shutil
import signal
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from multinode import NODE_TIER_ENV, Cluster
from test_peer_restore import STEPS, disk_chunks_hidden, flat, train_state

pytestmark = [pytest.mark.dist, pytest.mark.slow]  # a torchrun per node: ~30-60 s each here


@pytest.fixture
def shm(tmp_path: Path) -> Iterator[Path]:
    base = Path("/dev/shm")
    d = base / f"flashckpt-peer-{uuid.uuid4().hex[:12]}" if base.is_dir() else tmp_path / "shm"
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _checkpointer(root: str) -> Any:
    from flashckpt import Checkpointer

    return Checkpointer(
        root,
        memory_tier=os.environ[NODE_TIER_ENV],
        replicas=1,
        fsync=False,
        dist_timeout_s=60,
        chunk_size="16KiB",
    )


def save_and_hold(rank: int, world: int, node: int, root: str, ready: str) -> None:
    """Save every step, wait until it is replicated, say so, then wait to be SIGKILLed."""
    ck = _checkpointer(root)
    for step in STEPS:
        ck.save(step, train_state(rank, step)).wait(timeout=120)
    if ck._dist is not None and ck._dist.replicator is not None:
        ck._dist.replicator.drain()
    Path(ready, f"rank-{rank}").touch()
    time.sleep(600)


def restore_once(rank: int, world: int, node: int, root: str) -> dict[str, Any]:
    import torch

    from flashckpt.journal import read_events

    with _checkpointer(root) as ck:
        state = train_state(rank, 0)
        got = ck.restore(state)
    want = flat(train_state(rank, got)) if got is not None else {}
    have = flat(state)
    events = [e for e in read_events(Path(root)) if e.get("rank") == rank]
    peers = [e for e in events if e["event"] == "restored_from_peers"]
    return {
        "step": got,
        "bitwise": bool(want) and all(torch.equal(want[k], have[k]) for k in want),
        "peer_bytes": peers[-1]["bytes"] if peers else None,
        "tiers": [e["tier"] for e in events if e["event"] == "restore"],
    }


def _train_then_lose_nodes(tmp: Path, shm: Path, per_node: int, lost: list[int]) -> Path:
    """Run the job until every rank saved (and replicated) every step, SIGKILL every node,
    delete the memory tiers of the nodes in ``lost``; returns the root."""
    root, ready = tmp / "ckpt", tmp / "ready"
    ready.mkdir()
    cluster = Cluster(
        tmp / "run1", nodes=2, per_node=per_node, env=lambda i: {NODE_TIER_ENV: f"{shm}/n{i}"}
    )
    cluster.start("test_peer_restore_nodes:save_and_hold", root=str(root), ready=str(ready))
    deadline = time.monotonic() + 240
    while len(list(ready.iterdir())) < cluster.world:
        if time.monotonic() > deadline or any(p.poll() is not None for p in cluster.procs.values()):
            for i in cluster.procs:
                cluster.kill_node(i)
            pytest.fail(f"the job did not save every step:\n{cluster.tails()}")
        time.sleep(0.2)
    for node in (1, 0):  # node 1 is lost; the survivors are restarted with the job
        cluster.kill_node(node)
    for i in lost:
        shutil.rmtree(shm / f"n{i}")
    return root


def _restart(tmp: Path, shm: Path, per_node: int, root: Path) -> dict[int, Any]:
    cluster = Cluster(
        tmp / "run2", nodes=2, per_node=per_node, env=lambda i: {NODE_TIER_ENV: f"{shm}/n{i}"}
    )
    return cluster.run("test_peer_restore_nodes:restore_once", root=str(root), timeout_s=240)


@pytest.mark.parametrize("per_node", [1, 2])
def test_a_replacement_node_restores_from_its_peer_with_zero_disk_reads(
    tmp_path: Path, shm: Path, per_node: int
) -> None:
    root = _train_then_lose_nodes(tmp_path, shm, per_node, lost=[1])
    assert not (shm / "n1").exists()
    with disk_chunks_hidden(root):
        res = _restart(tmp_path, shm, per_node, root)
    for r, value in res.items():
        assert value["step"] == STEPS[-1] and value["bitwise"], (r, value)
        assert value["tiers"] == ["memory"], "loaded from its own node's tier"
    for r in range(per_node, 2 * per_node):
        assert res[r]["peer_bytes"] > 0, "the replacement node fetched its chunks from node 0"


def test_a_node_lost_with_its_peer_restores_from_the_disk(tmp_path: Path, shm: Path) -> None:
    root = _train_then_lose_nodes(tmp_path, shm, 1, lost=[0, 1])
    disk = sorted(int(p.name[:-5]) for p in (root / "steps").glob("*[0-9].json"))
    res = _restart(tmp_path, shm, 1, root)
    for r, value in res.items():
        assert disk and value["step"] == disk[-1] and value["bitwise"], (r, value)
        assert value["tiers"] == ["local"] and value["peer_bytes"] is None


def test_a_restarted_job_restores_from_the_node_tiers_with_zero_disk_reads(
    tmp_path: Path, shm: Path
) -> None:
    root = _train_then_lose_nodes(tmp_path, shm, 1, lost=[])
    with disk_chunks_hidden(root):
        res = _restart(tmp_path, shm, 1, root)
    for r, value in res.items():
        assert value["step"] == STEPS[-1] and value["bitwise"], (r, value)
        assert value["tiers"] == ["memory"]


def hold(rank: int, world: int, node: int, ready: str) -> None:
    Path(ready, f"rank-{rank}").touch()
    time.sleep(600)


def test_kill_node_kills_every_rank_of_the_node(tmp_path: Path) -> None:
    """torchrun starts each rank in a session of its own: killing torchrun's process group
    alone would leave the ranks running."""
    ready = tmp_path / "ready"
    ready.mkdir()
    cluster = Cluster(tmp_path / "run", nodes=1, per_node=2)
    cluster.start("test_peer_restore_nodes:hold", ready=str(ready))
    deadline = time.monotonic() + 120
    while len(list(ready.iterdir())) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert len(list(ready.iterdir())) == 2, cluster.tails()
    pids = [int(cluster.pid_file(r).read_text()) for r in (0, 1)]
    cluster.kill_node(0)
    alive = [p for p in pids if _state(p) not in ("Z", "gone")]
    for p in alive:  # never leave them behind, even when the test fails
        os.kill(p, signal.SIGKILL)
    assert not alive, f"ranks {alive} survived kill_node"


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()[0]
    except OSError:
        return "gone"
