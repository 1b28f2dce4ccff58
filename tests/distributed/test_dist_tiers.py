"""Tiers under torch.distributed: a memory tier shared by the ranks of one node, and the clear
error when a tier directory is not shared by every rank (a multi-node run's /dev/shm)."""

from __future__ import annotations

import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from test_commit import ddp_state

from flashckpt import Checkpointer
from flashckpt.errors import ConfigError
from flashckpt.journal import read_events
from flashckpt.store.files.backend import LocalBackend
from flashckpt.store.store import CheckpointStore

pytestmark = pytest.mark.dist


@pytest.fixture
def mem_dir(tmp_path: Path) -> Iterator[Path]:
    base = Path("/dev/shm")
    d = base / f"flashckpt-dist-{uuid.uuid4().hex[:12]}" if base.is_dir() else tmp_path / "shm"
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _bump(state: dict[str, Any]) -> None:
    with torch.no_grad():
        for p in state["model"].parameters():
            p.add_(0.5)


def memory_tier_job(rank: int, world: int, root: str, mem: str) -> dict[str, Any]:
    state = ddp_state(seed=0)
    kw: dict[str, Any] = {"fsync": False, "dist_timeout_s": 30, "keep_memory_after_close": True}
    with Checkpointer(root, memory_tier=mem, **kw) as ck:  # kept: the test looks at it
        ck.save(1, state)
        _bump(state)
        ck.save(2, state)
    expected = {k: v.clone() for k, v in state["model"].state_dict().items()}
    with Checkpointer(root, memory_tier=mem, **kw) as ck:
        fresh = ddp_state(seed=9)
        step = ck.restore(fresh)
    same = all(torch.equal(expected[k], v) for k, v in fresh["model"].state_dict().items())
    return {"step": step, "same": same}


def test_memory_tier_shared_by_the_ranks_of_one_node(
    ranks: Any, tmp_path: Path, mem_dir: Path
) -> None:
    root = tmp_path / "ckpt"
    results = ranks.ok(ranks(memory_tier_job, 2, tmp_path, str(root), str(mem_dir)))
    assert results == [{"step": 2, "same": True}] * 2
    assert CheckpointStore(LocalBackend(mem_dir)).steps() == [1, 2]
    assert 2 in CheckpointStore(LocalBackend(root)).steps(), "promoted to the disk tier"
    restores = [e for e in read_events(root) if e["event"] == "restore"]
    assert restores and all(e["tier"] == "memory" for e in restores[-2:]), restores


def node_local_job(rank: int, world: int, root: str, mem: str, per_rank: str) -> str:
    # different roots never meet in one barrier: they are told apart after dist_timeout_s
    kw: dict[str, Any] = {"fsync": False, "dist_timeout_s": 30 if per_rank == "memory" else 2}
    if per_rank == "memory":
        kw["memory_tier"] = f"{mem}/node{rank}"  # each "node" has its own /dev/shm
        where = root
    else:
        where = f"{root}/node{rank}"  # each "node" writes to its own local disk
    try:
        with Checkpointer(where, **kw):
            return "opened"
    except ConfigError as exc:
        if per_rank == "memory":  # the root's lock was released: it opens again on all ranks
            with Checkpointer(where, fsync=False, dist_timeout_s=30):
                pass
        return str(exc)


@pytest.mark.parametrize("per_rank", ["memory", "root"])
def test_directory_not_shared_by_every_rank_is_a_config_error_on_all_ranks(
    ranks: Any, tmp_path: Path, mem_dir: Path, per_rank: str
) -> None:
    root = tmp_path / "ckpt"
    results = ranks.ok(ranks(node_local_job, 2, tmp_path, str(root), str(mem_dir), per_rank))
    for msg in results:
        if per_rank == "memory":
            assert "not shared by all ranks" in msg, msg
            assert "rank 1 cannot see rank 0's memory tier" in msg
        else:  # each rank names both roots
            assert "different checkpoint roots" in msg, msg
            assert f"rank 0: {root}/node0" in msg and f"rank 1: {root}/node1" in msg
    assert not list(Path(mem_dir).rglob(".flashckpt-shared-*"))
    assert not list(root.rglob(".flashckpt-shared-*")), "markers are removed"
