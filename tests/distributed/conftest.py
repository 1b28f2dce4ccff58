"""Run a function on N real torch.distributed ranks (gloo on CPU), in forked processes.

Forking (not spawning) keeps a launch at about a second on a small machine: the children
inherit the imported torch. Each rank returns a picklable value; an exception on a rank is
returned as ``RankError`` so tests can assert on failures. A rank that exits without a result
(os._exit) is reported as ``None``.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import traceback
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

# Imported here, once, so that forked ranks inherit them instead of each paying ~1 s.
import torch._dynamo
import torch.distributed.fsdp
import torch.distributed.tensor  # noqa: F401


@dataclass
class RankError:
    type: str
    message: str
    phase: str
    ranks: list[int]
    tb: str


def _child(fn: Callable[..., Any], rank: int, world: int, init: str, out: Path, args: Any) -> None:
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
        try:
            result: Any = fn(rank, world, *args)
        except BaseException as exc:
            result = RankError(
                type=type(exc).__name__,
                message=str(exc),
                phase=getattr(exc, "phase", ""),
                ranks=list(getattr(exc, "ranks", [])),
                tb=traceback.format_exc(),
            )
        out.write_bytes(pickle.dumps(result))
    except BaseException:
        out.write_bytes(pickle.dumps(RankError("Harness", traceback.format_exc(), "", [], "")))
    finally:
        os._exit(0)  # never run pytest's teardown in a forked child


def run_ranks(
    fn: Callable[..., Any], world: int, tmp: Path, *args: Any, timeout_s: float = 60.0
) -> list[Any]:
    """``fn(rank, world, *args)`` on ``world`` ranks; their results in rank order."""
    tmp.mkdir(parents=True, exist_ok=True)
    init = f"file://{tmp}/store-{uuid.uuid4().hex}"
    ctx = mp.get_context("fork")
    outs = [tmp / f"result-{uuid.uuid4().hex}-{r}.pkl" for r in range(world)]
    procs = [
        ctx.Process(target=_child, args=(fn, r, world, init, outs[r], args)) for r in range(world)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout_s)
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    if hung:
        pytest.fail(f"ranks {hung} did not finish within {timeout_s}s")
    return [pickle.loads(o.read_bytes()) if o.exists() else None for o in outs]


def ok(results: list[Any]) -> list[Any]:
    """The results, failing the test with the traceback of any rank that raised."""
    for r, res in enumerate(results):
        if isinstance(res, RankError):
            pytest.fail(f"rank {r} raised {res.type}: {res.message}\n{res.tb}")
        if res is None:
            pytest.fail(f"rank {r} died without a result")
    return results


class Launcher:
    """What the ``ranks`` fixture gives a test: ``ranks(fn, world, tmp, *args)`` runs ``fn`` on
    ``world`` ranks; ``ranks.ok(results)`` fails the test if a rank raised or died."""

    def __call__(
        self, fn: Callable[..., Any], world: int, tmp: Path, *args: Any, timeout_s: float = 60.0
    ) -> list[Any]:
        return run_ranks(fn, world, tmp, *args, timeout_s=timeout_s)

    ok = staticmethod(ok)


@pytest.fixture(scope="session")
def ranks() -> Launcher:
    return Launcher()
