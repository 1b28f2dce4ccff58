"""DDP ownership and the commit protocol's failure paths, on real gloo ranks."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from flashckpt import Checkpointer
from flashckpt.errors import DistributedError
from flashckpt.state.rng import RNG
from flashckpt.store.files.backend import LocalBackend
from flashckpt.store.store import CheckpointStore

pytestmark = pytest.mark.dist


def ddp_state(seed: int) -> dict[str, Any]:
    torch.manual_seed(seed)
    model = nn.Sequential(*[nn.Linear(32, 32) for _ in range(6)])
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.Adam(ddp.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(3)
    for _ in range(2):
        opt.zero_grad()
        ddp(torch.randn(4, 32, generator=g)).pow(2).mean().backward()
        opt.step()
    return {"model": ddp, "optim": opt, "rng": RNG()}


def ddp_job(rank: int, world: int, root: str) -> dict[str, Any]:
    state = ddp_state(seed=0)
    with Checkpointer(root, fsync=False, dist_timeout_s=30) as ckpt:
        ckpt.save(1, state)
        fresh = ddp_state(seed=9)
        step = ckpt.restore(fresh)
    same = all(
        torch.equal(a, b)
        for a, b in zip(state["model"].state_dict().values(), fresh["model"].state_dict().values())
    )
    return {"step": step, "same": same}


def test_ddp_writes_replicated_tensors_once(ranks: Any, tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    results = ranks.ok(ranks(ddp_job, 2, tmp_path, str(root)))
    assert [r["step"] for r in results] == [1, 1]
    assert all(r["same"] for r in results)
    m = CheckpointStore(LocalBackend(root)).load_manifest(1)
    per_rank = {0: 0, 1: 0}
    for key, entry in m.tensors.items():
        if key.startswith(("model/", "optim/")):
            assert len(entry.shards) == 1, f"{key} written {len(entry.shards)} times"
            per_rank[entry.shards[0].rank] += entry.nbytes
    assert min(per_rank.values()) > 0.8 * max(per_rank.values()), per_rank
    assert {"rng/torch@rank0", "rng/torch@rank1"} <= set(m.tensors)


@contextmanager
def closing(ckpt: Checkpointer) -> Iterator[Checkpointer]:
    """Close at the end; the save error the test already caught may be raised again there."""
    try:
        yield ckpt
    finally:
        try:
            ckpt.close()
        except DistributedError:
            pass


class FailingPut:
    """Backend wrapper: ``put`` raises for paths starting with ``prefix``."""

    def __init__(self, backend: Any, prefix: str, *, die: bool = False) -> None:
        self.backend, self.prefix, self.die = backend, prefix, die
        self.plain = backend.put

    def __call__(self, path: str, parts: Any) -> int:
        if path.startswith(self.prefix):
            if self.die:
                os._exit(17)  # a rank dying mid-save
            raise OSError(28, f"injected failure writing {path}")
        return self.plain(path, parts)


def small_state(rank: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model = nn.Linear(16, 16)
    return {"model": model, "data": {"pos": rank}}


def failure_job(rank: int, world: int, root: str, bad: int, where: str, mode: str) -> Any:
    state = small_state(rank)
    with closing(
        Checkpointer(root, fsync=False, dist_timeout_s=20, async_save=mode == "async")
    ) as ckpt:
        ckpt.save(1, state).wait()
        before = state["model"].weight.detach().clone()
        with torch.no_grad():  # new bytes for both owners (weight: rank 0, bias: rank 1)
            for p in state["model"].parameters():
                p.add_(1.0)
        backend = ckpt.store.backend
        if rank == bad:
            backend.put = FailingPut(backend, where)  # type: ignore[method-assign]
        try:
            ckpt.save(2, state).wait()
            error: Any = None
        except DistributedError as exc:
            error = (str(exc), exc.phase, exc.ranks)
        backend.put = FailingPut(backend, "nothing")  # type: ignore[method-assign]
        step = ckpt.restore(state)
        restored = torch.equal(state["model"].weight, before)
    return {"error": error, "step": step, "restored": restored}


@pytest.mark.parametrize(
    ("bad", "where", "phase", "mode"),
    [
        (1, "chunks/", "save", "sync"),
        (1, "chunks/", "save", "async"),
        (1, "steps/", "save", "sync"),  # writing its part fails
        (0, "steps/000000000002.json", "publish", "async"),
    ],
)
def test_failure_on_one_rank(
    ranks: Any, tmp_path: Path, bad: int, where: str, phase: str, mode: str
) -> None:
    root = tmp_path / "ckpt"
    results = ranks.ok(ranks(failure_job, 2, tmp_path, str(root), bad, where, mode))
    errors = [r["error"] for r in results]
    assert errors[0] is not None and errors[0] == errors[1], errors  # the same error everywhere
    message, got_phase, failed = errors[0]
    assert (got_phase, failed) == (phase, [bad])
    assert "injected failure" in message and "nothing was published" in message
    store = CheckpointStore(LocalBackend(root))
    assert store.steps() == [1]
    assert not store.part_names()
    assert [r["step"] for r in results] == [1, 1]
    assert all(r["restored"] for r in results)


def dying_job(rank: int, world: int, root: str) -> Any:
    state = small_state(rank)
    with closing(Checkpointer(root, fsync=False, dist_timeout_s=2)) as ckpt:
        ckpt.save(1, state)
        if rank == 1:
            backend = ckpt.store.backend
            backend.put = FailingPut(backend, "chunks/", die=True)  # type: ignore[method-assign]
        with torch.no_grad():
            for p in state["model"].parameters():
                p.add_(1.0)
        t0 = time.monotonic()
        try:
            ckpt.save(2, state)
        except DistributedError as exc:
            after = time.monotonic() - t0
            return {"phase": exc.phase, "ranks": exc.ranks, "msg": str(exc), "after": after}
    return {"phase": None}


def test_dead_rank_times_out(ranks: Any, tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    results = ranks(dying_job, 2, tmp_path, str(root), timeout_s=30)
    assert results[1] is None  # rank 1 died
    got = results[0]
    assert got["phase"] == "save" and got["ranks"] == [1], got
    assert "timeout" in got["msg"]
    assert 2 <= got["after"] < 10
    assert CheckpointStore(LocalBackend(root)).steps() == [1]
