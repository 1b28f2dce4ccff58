"""Decisions every rank must share: Store names, the save tier, and what restore leaves alone."""

from __future__ import annotations

import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from test_reshard import build, full, train
from torch import nn

from flashckpt import Checkpointer
from flashckpt.store.files.backend import LocalBackend
from flashckpt.store.store import CheckpointStore

pytestmark = pytest.mark.dist


def names_job(rank: int, world: int, tmp: str) -> dict[str, Any]:
    solo = dist.new_group([0])  # every rank takes part in creating the group
    extra = None
    if rank == 0:  # an eval Checkpointer on rank 0 only, created first
        extra = Checkpointer(f"{tmp}/eval", process_group=solo, fsync=False, dist_timeout_s=5)
    torch.manual_seed(0)
    model = nn.Linear(4, 4)
    a = Checkpointer(f"{tmp}/a", fsync=False, dist_timeout_s=5)
    b = Checkpointer(f"{tmp}/b", fsync=False, dist_timeout_s=5)
    a.save(1, {"model": model})
    with torch.no_grad():
        model.weight.add_(1.0)
    b.save(1, {"model": model})  # same step, another root: other keys
    b.save(2, {"model": model})
    a.save(2, {"model": model})
    if extra is not None:
        extra.save(7, {"model": model})
        extra.close()
    got = (a.restore({"model": model}), b.restore({"model": model}))
    a.close()
    b.close()
    return {"restored": got}


def test_store_names_follow_the_root_not_creation_order(ranks: Any, tmp_path: Path) -> None:
    """An extra Checkpointer on rank 0 shifted a per-process counter: every barrier of the
    others then waited for keys nobody wrote."""
    results = ranks.ok(ranks(names_job, 2, tmp_path, str(tmp_path)))
    assert [r["restored"] for r in results] == [(2, 2)] * 2
    assert CheckpointStore(LocalBackend(tmp_path / "a")).steps() == [1, 2]
    assert CheckpointStore(LocalBackend(tmp_path / "b")).steps() == [1, 2]
    assert CheckpointStore(LocalBackend(tmp_path / "eval")).steps() == [7]


@pytest.fixture
def mem_dir(tmp_path: Path) -> Iterator[Path]:
    base = Path("/dev/shm")
    d = base / f"flashckpt-agree-{uuid.uuid4().hex[:12]}" if base.is_dir() else tmp_path / "shm"
    yield d
    shutil.rmtree(d, ignore_errors=True)


def tier_job(rank: int, world: int, root: str, mem: str, full_on: int) -> dict[str, Any]:
    if rank == full_on:  # this rank sees /dev/shm (nearly) full
        import flashckpt.engine.tiers.tierset as tiers

        real = tiers.shutil.disk_usage

        def disk_usage(path: Any) -> Any:
            u = real(path)
            return type(u)(u.total, u.total, 0) if str(path).startswith(mem) else u

        tiers.shutil.disk_usage = disk_usage  # type: ignore[assignment]
    torch.manual_seed(0)
    model = nn.Linear(16, 16)
    kw: dict[str, Any] = {"fsync": False, "dist_timeout_s": 10, "keep_memory_after_close": True}
    with Checkpointer(root, memory_tier=mem, **kw) as ck:  # the test looks at the tier
        ck.save(1, {"model": model, "data": {"pos": rank}})
        ck.wait()
    return {"ok": True}


@pytest.mark.parametrize("full_on", [0, 1])
def test_rank_zero_picks_the_tier_of_every_rank(
    ranks: Any, tmp_path: Path, mem_dir: Path, full_on: int
) -> None:
    """Rank 1 alone seeing a full memory tier used to save to the disk tier while rank 0
    used memory: publish failed and stale parts were left behind."""
    root = tmp_path / "ckpt"
    ranks.ok(ranks(tier_job, 2, tmp_path, str(root), str(mem_dir), full_on))
    mem = CheckpointStore(LocalBackend(mem_dir))
    disk = CheckpointStore(LocalBackend(root))
    if full_on == 0:  # rank 0 falls back to the disk tier, for everyone
        assert mem.steps() == [] and disk.steps() == [1]
    else:  # rank 1's view does not count: memory, then promoted
        assert mem.steps() == [1]
    assert not mem.part_names() and not disk.part_names()


def optim_job(rank: int, world: int, root: str) -> dict[str, Any]:
    out = {}
    for restore in (False, True):
        net, opt = build(world, seed=0)
        if restore:
            with Checkpointer(root, fsync=False, dist_timeout_s=10) as ck:
                assert ck.restore({"model": net, "optim": opt}) is None
            assert not opt.state, "restore that loads nothing gave the optimizer state"
        train(net, opt, 1)
        steps = {float(s["step"]) for s in opt.state.values()}
        out[restore] = (full(net.state_dict()), steps)
    same = all(torch.equal(out[False][0][k], v) for k, v in out[True][0].items())
    return {"same": same, "steps": (out[False][1], out[True][1])}


def test_restore_that_loads_nothing_leaves_the_optimizer_alone(ranks: Any, tmp_path: Path) -> None:
    """On FSDP2, restore() on an empty root ran a zero-lr step(): Adam then started at step 1
    and the first real update differed."""
    results = ranks.ok(ranks(optim_job, 2, tmp_path, str(tmp_path / "empty")))
    for r in results:
        assert r["steps"] == ({1.0}, {1.0}), r["steps"]
        assert r["same"]


def keys_job(rank: int, world: int, root: str) -> list[int]:
    from torch.distributed import distributed_c10d as c10d

    store = c10d._get_default_store()
    torch.manual_seed(0)
    model = nn.Linear(4, 4)
    counts = []
    with Checkpointer(root, fsync=False, dist_timeout_s=10, keep=2) as ck:
        for step in range(1, 16):
            ck.save(step, {"model": model})
            ck.restore({"model": model})
            if step in (5, 15):
                dist.barrier()
                counts.append(int(store.num_keys()))
                dist.barrier()
    return counts


def test_store_keys_do_not_pile_up(ranks: Any, tmp_path: Path) -> None:
    """Each phase's keys are deleted once every rank moved on: ten more saves and restores
    leave no more keys behind than five."""
    for counts in ranks.ok(ranks(keys_job, 2, tmp_path, str(tmp_path / "ckpt"))):
        assert counts[1] <= counts[0], counts
