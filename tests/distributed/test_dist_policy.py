"""Save policies under torch.distributed: clock-based policies (EverySeconds, Auto) decide on
rank 0 and every rank follows, so all ranks save the same steps although their clocks differ."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from flashckpt import Checkpointer
from flashckpt.policy import Auto, EverySeconds, EverySteps
from flashckpt.policy.save import step_based
from flashckpt.store.files.backend import LocalBackend
from flashckpt.store.store import CheckpointStore

pytestmark = pytest.mark.dist


def policy_job(rank: int, world: int, root: str, kind: str) -> dict[str, Any]:
    import torch.distributed as dist

    model = nn.Linear(8, 8)
    policy = EverySeconds(0.12) if kind == "seconds" else Auto(mtbf_s=2.0, prior_cost_s=0.01)
    decisions = []
    with Checkpointer(root, fsync=False, save_policy=policy, dist_timeout_s=30) as ck:
        for step in range(1, 25):
            # rank 1's steps take twice as long: its own clock would pick other steps
            time.sleep(0.02 * (1 + rank))
            with torch.no_grad():
                model.weight.add_(1.0)
            if ck.should_save(step):
                decisions.append(step)
                ck.save(step, {"model": model})
        dist.barrier()
        ctx = ck._dist.ctx
        leftover = [s for s in range(1, 25) if ctx.store.check([f"{ctx.name}/should-save/{s}"])]
    return {"decisions": decisions, "leftover": leftover}


@pytest.mark.parametrize("kind", ["seconds", "auto"])
def test_clock_based_policy_saves_the_same_steps_on_every_rank(
    ranks: Any, tmp_path: Path, kind: str
) -> None:
    root = tmp_path / "ckpt"
    results = ranks.ok(ranks(policy_job, 2, tmp_path, str(root), kind))
    first, second = results[0]["decisions"], results[1]["decisions"]
    assert first and first == second, (first, second)
    assert CheckpointStore(LocalBackend(root)).steps()[-1] == first[-1]
    assert results[0]["leftover"] == [] and results[1]["leftover"] == [], "store keys removed"


def test_step_based_policies_need_no_agreement() -> None:
    assert step_based(EverySteps(5)) and step_based(EverySteps(5) | EverySteps(7))
    assert not step_based(EverySeconds(60)) and not step_based(EverySteps(5) | EverySeconds(60))
    assert not step_based(Auto(mtbf_s=3600.0))


def preempt_job(rank: int, world: int, root: str) -> dict[str, Any]:
    import os
    import signal

    from flashckpt.engine.runtime.preempt import Preempted

    model = nn.Linear(8, 8)
    step = 0
    try:
        with Checkpointer(
            root,
            fsync=False,
            save_policy=100,
            handle_sigterm=True,
            emergency_save=True,
            grace_period_s=20,
            dist_timeout_s=30,
        ) as ck:
            for step in range(1, 40):
                with torch.no_grad():
                    model.weight.add_(1.0)
                if rank == 0 and step == 5:
                    os.kill(os.getpid(), signal.SIGTERM)  # only rank 0 is signalled
                if ck.should_save(step):
                    ck.save(step, {"model": model})
    except Preempted:
        return {"stopped_at": step, "preempted": True}
    return {"stopped_at": step, "preempted": False}


def test_sigterm_on_one_rank_stops_every_rank_at_the_same_step_with_one_final_save(
    ranks: Any, tmp_path: Path
) -> None:
    """Ranks receive SIGTERM at different moments (here only rank 0 does): rank 0 decides at
    should_save, every rank takes the emergency save of that same step and exits cleanly."""
    root = tmp_path / "ckpt"
    results = ranks.ok(ranks(preempt_job, 2, tmp_path, str(root)))
    assert results == [{"stopped_at": 5, "preempted": True}] * 2, results
    assert CheckpointStore(LocalBackend(root)).steps() == [5]


def absent_leader_job(rank: int, world: int, root: str, kind: str) -> dict[str, Any]:
    """Rank 0 stops answering (hung, or behind by many steps) while rank 1 asks whether to save:
    rank 1 must get a DistributedError within dist_timeout_s, not wait on the Store's 30 min."""
    from flashckpt.errors import DistributedError

    kw: dict[str, Any] = {"fsync": False, "dist_timeout_s": 2}
    if kind == "sigterm":
        kw.update(save_policy=100, handle_sigterm=True)
    else:
        kw.update(save_policy=EverySeconds(0.01))
    ck = Checkpointer(root, **kw)
    if rank == 0:
        time.sleep(8)  # never asks: rank 1 must not wait for it past dist_timeout_s
        return {"rank": 0}
    t0 = time.monotonic()
    try:
        ck.should_save(1)
    except DistributedError as exc:
        return {"error": "DistributedError", "msg": str(exc), "s": time.monotonic() - t0}
    return {"error": None, "s": time.monotonic() - t0}


@pytest.mark.parametrize("kind", ["seconds", "sigterm"])
def test_should_save_waits_for_rank_0_at_most_dist_timeout_s(
    ranks: Any, tmp_path: Path, kind: str
) -> None:
    results = ranks.ok(
        ranks(absent_leader_job, 2, tmp_path, str(tmp_path / "ckpt"), kind, timeout_s=30)
    )
    got = results[1]
    assert got["error"] == "DistributedError", got
    assert "dist_timeout_s" in got["msg"] and "step 1" in got["msg"], got["msg"]
