"""Peer replication across simulated nodes: one torchrun per node on loopback
(:mod:`multinode`), each node with its own memory-tier directory."""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from multinode import NODE_TIER_ENV, Cluster

from flashckpt.store.backend import LocalBackend
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

    torch.manual_seed(seed)
    return nn.Sequential(*[nn.Linear(64, 64) for _ in range(4)])


def save_steps(rank: int, world: int, node: int, root: str, steps: list[int]) -> dict[str, Any]:
    """Save ``steps`` with replicas=1 into this node's memory tier (``NODE_TIER_ENV``)."""
    import torch

    from flashckpt import Checkpointer

    model = _model(0)
    with Checkpointer(
        root,
        memory_tier=os.environ[NODE_TIER_ENV],
        replicas=1,
        fsync=False,
        dist_timeout_s=30,
        keep_memory=2,
    ) as ck:
        for step in steps:
            with torch.no_grad():
                model[rank % 4].weight.add_(1.0)  # one layer changes per rank and step
            ck.save(step, {"model": model})
        nodes = ck._dist.nodes if ck._dist is not None else None
    return {"node": node, "label": nodes.node_of(rank) if nodes else None}


def test_two_torchrun_nodes_publish_in_their_own_memory_tiers(tmp_path: Path, shm: Path) -> None:
    cluster = Cluster(tmp_path, nodes=2, per_node=1, env=lambda i: {NODE_TIER_ENV: f"{shm}/n{i}"})
    res = cluster.run("test_replication:save_steps", root=str(tmp_path / "ckpt"), steps=[1, 2])
    assert [res[r]["label"] for r in (0, 1)] == ["node-0", "node-1"], "from torchrun's GROUP_RANK"
    for i in (0, 1):
        assert CheckpointStore(LocalBackend(shm / f"n{i}")).steps() == [1, 2]
