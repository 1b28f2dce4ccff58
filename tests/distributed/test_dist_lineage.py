"""Lineage under torch.distributed: every rank records rank 0's run generation (issue 27)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from flashckpt import Checkpointer
from flashckpt.store.files.backend import LocalBackend
from flashckpt.store.format.lineage import Lineage
from flashckpt.store.generation import read_generation
from flashckpt.store.store import CheckpointStore

pytestmark = pytest.mark.dist


def two_writers(rank: int, world: int, root: str, mem: str) -> dict[str, Any]:
    gens = []
    state = {"w": torch.full((64,), float(rank))}
    with Checkpointer(root, memory_tier=mem, fsync=False, dist_timeout_s=30) as ckpt:
        gens.append(ckpt._branch.generation)
        ckpt.save(1, state)  # never restored: branch point unknown
    with Checkpointer(root, memory_tier=mem, fsync=False, dist_timeout_s=30) as ckpt:
        gens.append(ckpt._branch.generation)
        got = ckpt.restore(state)
        ckpt.save(2, state)
    return {"gens": gens, "restored": got}


def test_every_rank_takes_rank_0s_generation(ranks: Any, tmp_path: Path) -> None:
    root, mem = tmp_path / "ckpt", tmp_path / "shm"
    results = ranks.ok(ranks(two_writers, 2, tmp_path, str(root), str(mem)))
    assert [r["gens"] for r in results] == [[1, 2], [1, 2]]
    assert [r["restored"] for r in results] == [1, 1]
    assert read_generation(root) == 2
    store = CheckpointStore(LocalBackend(root))
    assert store.load_manifest(1).lineage == Lineage(generation=1, parent_generation=0)
    assert store.load_manifest(2).lineage == Lineage(
        generation=2, parent_generation=1, parent_step=1
    )


# -- node tiers (peer replication): each node's leader removes its tier's abandoned copies ------


def _node_opts(rank: int, mem: str) -> dict[str, Any]:
    from flashckpt.engine.options import Replication

    return {
        "memory_tier": f"{mem}/n{rank}",  # one rank per node: node r's tier
        "replicas": Replication(placement=lambda r: f"n{r}", timeout_s=30),
        "fsync": False,
        "dist_timeout_s": 30,
        "chunk_size": "16KiB",
        "keep_memory": 10,
        "keep_memory_after_close": True,  # the test looks at the node tiers after close
    }


def _node_state(rank: int, step: int, base: float) -> dict[str, Any]:
    return {"data": {"w": torch.arange(4096, dtype=torch.float32) + 1000 * rank + step + base}}


def node_save_job(
    rank: int, world: int, root: str, mem: str, steps: list[int], base: float, restore: bool
) -> int:
    with Checkpointer(root, **_node_opts(rank, mem)) as ck:
        got = ck.restore(_node_state(rank, 0, -1.0)) if restore else -1
        for step in steps:
            ck.save(step, _node_state(rank, step, base)).durable.result(timeout=60)
        if ck._dist is not None and ck._dist.replicator is not None:
            ck._dist.replicator.drain()
    return -1 if got is None else got  # (None reads as a rank that died)


def node_restore_job(rank: int, world: int, root: str, mem: str) -> dict[str, Any]:
    from flashckpt.journal import read_events

    state = _node_state(rank, 0, -1.0)
    with Checkpointer(root, **_node_opts(rank, mem)) as ck:
        got = ck.restore(state)
        tier = CheckpointStore(LocalBackend(Path(mem) / f"n{rank}"))
        held = {s: tier.load_manifest(s).lineage for s in tier.steps()}
    events = [
        (e.get("rank"), e["step"], e["tier"], e["removed"])
        for e in read_events(Path(root))
        if e["event"] == "abandoned_copy"
    ]
    want = _node_state(rank, got, 100.0) if got is not None else {}
    return {
        "step": got,
        "bitwise": bool(want) and torch.equal(state["data"]["w"], want["data"]["w"]),
        "held": {s: (lin.generation if lin else None) for s, lin in held.items()},
        "abandoned": events,
    }


def test_an_abandoned_copy_in_a_node_tier_is_removed_by_its_node(
    ranks: Any, tmp_path: Path
) -> None:
    """Run 1 (generation 1) saves 1-3 on nodes A; step 3 reaches only node 1's tier (its disk
    and node-0 copies are gone, as when the job died before promoting it). Run 2 on other
    nodes B restores 2 and saves 3 again. Run 3 lands back on nodes A: it restores run 2's step
    3, and node 1's copy of run 1's step 3 (abandoned) is removed from node 1's tier by node 1,
    journaled ``abandoned_copy``; its live copies (1, 2) stay."""
    root, mem_a, mem_b = tmp_path / "ckpt", tmp_path / "shm-a", tmp_path / "shm-b"
    run = lambda job, *a: ranks.ok(ranks(job, 2, tmp_path, str(root), *a, timeout_s=120))  # noqa: E731
    run(node_save_job, str(mem_a), [1, 2, 3], 0.0, False)
    disk, node0 = CheckpointStore(LocalBackend(root)), CheckpointStore(LocalBackend(mem_a / "n0"))
    disk.delete_step(3)
    node0.delete_step(3)
    assert CheckpointStore(LocalBackend(mem_a / "n1")).steps() == [1, 2, 3]
    assert run(node_save_job, str(mem_b), [3], 100.0, True) == [2, 2]
    assert disk.load_manifest(3).lineage == Lineage(
        generation=2, parent_generation=1, parent_step=2
    )
    res = run(node_restore_job, str(mem_a))
    for r in res:
        assert r["step"] == 3 and r["bitwise"], r
    assert res[1]["held"] == {1: 1, 2: 1}, "node 1's abandoned copy of step 3 is gone"
    assert res[0]["held"] == {1: 1, 2: 1}
    assert res[1]["abandoned"] == [(1, 3, "memory", True)], "journaled once, by node 1"
