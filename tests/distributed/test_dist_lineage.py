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
