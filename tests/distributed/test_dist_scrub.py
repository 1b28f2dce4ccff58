"""The idle scrub under torch.distributed (issue 27): each node's memory tier is scrubbed by
its node's leader (peer replication: the tiers are node-local), the disk tier by rank 0 only.
Real gloo ranks whose nodes are told apart by ``Replication(placement=...)``, each node with its
own memory-tier directory."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from flashckpt import Checkpointer
from flashckpt.engine.options import Replication
from flashckpt.store.files.backend import LocalBackend
from flashckpt.store.store import CheckpointStore, chunk_path

pytestmark = pytest.mark.dist

WAIT_S = 30.0  # the scrub reads the whole (small) tier in its first step after QUIET_S


def _journal(root: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in (root / "journal.jsonl").read_text().splitlines()]


def _flip(path: Path) -> None:
    time.sleep(0.02)  # past the write's clock tick (see tests/core/test_inplace_damage.py)
    size = path.stat().st_size
    fd = os.open(path, os.O_RDWR)
    try:
        (b,) = os.pread(fd, 1, size // 2)
        os.pwrite(fd, bytes([b ^ 0x10]), size // 2)  # same size, bytes changed in place
    finally:
        os.close(fd)
    assert path.stat().st_size == size


def _own_chunk(tier: CheckpointStore, step: int, rank: int) -> Any:
    """A chunk of ``step`` that only ``rank`` writes (its per-rank entry)."""
    m = tier.load_manifest(step)
    entry = m.tensors[f"data/w@rank{rank}"]
    return m.chunks[entry.shards[0].extents[0].chunk]


def scrub_job(rank: int, world: int, root: str, mem: str) -> dict[str, Any]:
    import torch.distributed as dist

    from flashckpt.engine.runtime import hostcpu
    from flashckpt.engine.tiers import scrubbing

    scrubbing.QUIET_S = 0.1
    hostcpu.MIN_IDLE_CORES = 0.0  # the other ranks and tests keep the cores busy
    node = Path(mem) / f"n{rank}"
    state = {"data": {"w": torch.arange(16384, dtype=torch.float32) + 1000 * rank}}
    opts: dict[str, Any] = {
        "memory_tier": str(node),  # one rank per node: node r's tier
        "replicas": Replication(placement=lambda r: f"n{r}", timeout_s=30),
        "fsync": False,
        "dist_timeout_s": 30,
        "chunk_size": "16KiB",
        "scrub_bytes_per_s": "64MiB",
        "keep_memory_after_close": True,
    }
    out: dict[str, Any] = {}
    with Checkpointer(root, **opts) as ck:
        idle = ck._tiers.promoter._idle
        out["scrubs"] = [t.name for t, _ in getattr(idle, "_cursors", [])]
        ck.save(1, state).durable.result(timeout=60)
        if ck._dist is not None and ck._dist.replicator is not None:
            ck._dist.replicator.drain()
        dist.barrier()
        tier = CheckpointStore(LocalBackend(node, fsync=False))
        ref = _own_chunk(tier, 1, 1)
        if rank == 1:  # damage node 1's copy of one of rank 1's chunks, in place
            _flip(node / chunk_path(ref.hash, ref.codec))
        deadline = time.monotonic() + WAIT_S
        found: list[dict[str, Any]] = []
        while rank == 1 and not found and time.monotonic() < deadline:
            found = [e for e in _journal(Path(root)) if e["event"] == "scrub_damage"]
            time.sleep(0.05)
        dist.barrier()
        out["damage"] = [e for e in _journal(Path(root)) if e["event"] == "scrub_damage"]
        out["after_scrub"] = (node / chunk_path(ref.hash, ref.codec)).exists()
        ck.save(2, state).durable.result(timeout=60)  # the same bytes: writes the chunk again
        if ck._dist is not None and ck._dist.replicator is not None:
            ck._dist.replicator.drain()
        dist.barrier()
    fresh = CheckpointStore(LocalBackend(node, fsync=False))
    out["rewritten"] = bytes(fresh.read_chunk(ref)) != b""  # verified against its hash
    out["chunk"] = ref.hash
    return out


def test_each_node_tier_is_scrubbed_by_its_node_and_damage_is_rewritten(
    ranks: Any, tmp_path: Path
) -> None:
    root, mem = tmp_path / "ckpt", tmp_path / "shm"
    res = ranks.ok(ranks(scrub_job, 2, tmp_path, str(root), str(mem), timeout_s=120))
    damage = [(e.get("rank"), e["tier"], e["chunk"], e["steps"]) for e in res[1]["damage"]]
    assert res[0]["scrubs"] == ["memory", "local"], "node 0's tier, and the disk once"
    assert res[1]["scrubs"] == ["memory"], "node 1's own tier only"
    assert damage == [(1, "memory", res[1]["chunk"], [1])], "node 1 scrubbed its own tier"
    assert res[1]["damage"][0]["quarantined"] is True
    assert res[1]["after_scrub"] is False, "the damaged copy was quarantined"
    assert res[1]["rewritten"], "the next save wrote it again, verified"
