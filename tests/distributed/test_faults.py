"""The fault matrix on real gloo ranks: raise / hang / SIGKILL on each rank, in each phase of
save and restore. Every case must end within a bounded time with one identical error on every
surviving rank, no step or part visible in any tier, older checkpoints intact, and (for raise
and hang) the following save and restore working.

Raise and hang cases run one after another inside one process group (one spawn for many
cases); a SIGKILL ends its group, so each kill case spawns its own.
"""

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
import torch
import torch.distributed as dist
from torch import nn

from flashckpt import Checkpointer
from flashckpt.cli import main as cli_main
from flashckpt.errors import DistributedError
from flashckpt.store.files.backend import LocalBackend
from flashckpt.store.store import CheckpointStore

pytestmark = pytest.mark.dist

T = 1.5  # dist_timeout_s of these tests
HANG_S = 2.5 * T  # longer than any barrier waits for a rank (2 x timeout at most)


class Injector:
    """What a rank does at one point of a save or restore: nothing, raise, hang or die."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.case: tuple[int, str, str] | None = None  # (rank, point, mode)

    def at(self, point: str) -> None:
        if self.case is None or self.case[:2] != (self.rank, point):
            return
        mode = self.case[2]
        if mode == "raise":
            raise OSError(28, f"injected failure at {point} on rank {self.rank}")
        if mode == "hang":
            self.case = None  # once
            time.sleep(HANG_S)
        if mode == "kill":
            os.kill(os.getpid(), signal.SIGKILL)


class Data:
    """Per-rank state whose ``state_dict()`` is an injection point (a failing Stateful)."""

    def __init__(self, inj: Injector) -> None:
        self.inj, self.pos = inj, inj.rank

    def state_dict(self) -> dict[str, Any]:
        self.inj.at("state_dict")
        return {"pos": self.pos}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.inj.at("load")
        self.pos = sd["pos"]


def instrument(ckpt: Checkpointer, inj: Injector) -> None:
    """Injection points in the save tier's backend (chunks, parts, the manifest; promotions to
    the disk tier are left alone), in the tier choice, and before the save job exists (a
    pending error delivered on one rank)."""
    backend = ckpt._tiers.fastest.store.backend
    plain = backend.put

    def put(path: str, parts: Any) -> int:
        if path.startswith("chunks/"):
            inj.at("chunks")
        elif ".rank-" in path:
            inj.at("part")
        elif path.startswith("steps/"):
            inj.at("publish")
            n = int(plain(path, parts))
            inj.at("published")  # the manifest is written: nobody was told yet
            return n
        return int(plain(path, parts))

    backend.put = put  # type: ignore[method-assign]
    open_staged = getattr(backend, "open_staged", None)
    if open_staged is not None:  # a memory tier: chunks are written as they are staged

        def staged(head: str, size: int | None = None) -> Any:
            inj.at("chunks")
            return open_staged(head, size)

        backend.open_staged = staged  # type: ignore[method-assign]
    # the first thing a save does: deliver the error a previous save left (engine/runtime/saving.py)
    pending, target = ckpt._inflight.raise_pending, ckpt._tiers.target

    def raise_pending() -> None:
        inj.at("pending")
        pending()

    def choose(**kw: Any) -> Any:
        inj.at("tier")
        return target(**kw)

    ckpt._inflight.raise_pending = raise_pending  # type: ignore[method-assign]
    ckpt._tiers.target = choose  # type: ignore[method-assign]


def new_state(inj: Injector, seed: int) -> dict[str, Any]:
    torch.manual_seed(seed)
    return {"model": nn.Linear(8, 8), "data": Data(inj)}


def bump(state: dict[str, Any]) -> None:
    with torch.no_grad():
        for p in state["model"].parameters():
            p.add_(1.0)


def open_ckpt(root: str, mem: str, mode: str = "sync") -> Checkpointer:
    return Checkpointer(
        root,
        memory_tier=mem,
        keep=100,
        keep_memory=100,
        fsync=False,
        dist_timeout_s=T,
        async_save=mode == "async",
    )


def visible(root: str, mem: str) -> dict[str, Any]:
    """Steps and parts in both tiers."""
    out: dict[str, Any] = {}
    for name, d in (("local", root), ("memory", mem)):
        store = CheckpointStore(LocalBackend(Path(d)))
        out[name] = (store.steps(), store.part_names())
    return out


def outcome(fn: Any) -> tuple[Any, float]:
    t0 = time.monotonic()
    try:
        fn()
        return None, time.monotonic() - t0
    except DistributedError as exc:
        return (str(exc), exc.phase, exc.ranks), time.monotonic() - t0


def matrix_job(
    rank: int, world: int, root: str, mem: str, cases: list[tuple[int, str, str]], mode: str
) -> list[dict[str, Any]]:
    """Each case: save (or restore) with the fault injected, then a clean save and restore."""
    inj = Injector(rank)
    state = new_state(inj, seed=0)
    out = []
    with open_ckpt(root, mem, mode) as ckpt:
        instrument(ckpt, inj)
        ckpt.save(1, state).wait()
        step = 2
        for case in cases:
            bump(state)
            inj.case = case
            if case[1] == "load":
                err, took = outcome(lambda: ckpt.restore(state))
            else:
                err, took = outcome(lambda step=step: ckpt.save(step, state).wait())
            inj.case = None
            dist.barrier()  # training's next collective: a hung rank has caught up
            seen = visible(root, mem)
            ckpt.save(step + 1, state).wait()  # the next save works
            restored = ckpt.restore(state)
            out.append({"error": err, "took": took, "seen": seen, "restored": restored})
            step += 2
    return out


PHASE = {
    "pending": "plan",  # before the save job exists
    "state_dict": "plan",
    "tier": "plan",
    "chunks": "save",
    "part": "save",
    "publish": "publish",
    "load": "restore",
}


def check_case(case: tuple[int, str, str], got: list[dict[str, Any]], before: list[int]) -> None:
    bad, point, how = case
    errors = [g["error"] for g in got]
    assert errors[0] is not None, f"{case}: no error"
    assert all(e == errors[0] for e in errors), f"{case}: ranks disagree: {errors}"
    message, phase, ranks = errors[0]
    assert ranks == [bad], (case, errors[0])
    if how == "raise" or point != "load":  # a rank hung in restore: the "load-<step>" barrier
        assert phase == PHASE[point], (case, errors[0])
    if how == "raise":
        assert "injected failure" in message, (case, message)
    else:
        assert "timeout" in message, (case, message)
    for g in got:
        assert g["took"] < (HANG_S + 2 * T + 5 if how == "hang" else 2 * T + 5), (case, g["took"])
        mem_steps, _ = g["seen"]["memory"]
        assert mem_steps == before, f"{case}: memory tier shows {mem_steps}, expected {before}"
        for tier, (steps, parts) in g["seen"].items():  # the disk tier: promoted (async)
            assert set(steps) <= set(before), f"{case}: {tier} tier shows {steps}"
            assert not parts, f"{case}: parts left in the {tier} tier: {parts}"
        assert g["restored"] == before[-1] + 2, (case, g["restored"])  # the next save


SAVE_POINTS = ["pending", "state_dict", "chunks", "part"]
RAISE_CASES = (
    [(r, p, "raise") for r in (0, 1) for p in SAVE_POINTS]
    + [(0, "tier", "raise"), (0, "publish", "raise")]
    + [(r, "load", "raise") for r in (0, 1)]
)
HANG_CASES = [
    (0, "state_dict", "hang"),
    (1, "chunks", "hang"),
    (0, "publish", "hang"),
    (1, "load", "hang"),
]


@pytest.fixture
def mem_dir(tmp_path: Path) -> Iterator[Path]:
    base = Path("/dev/shm")
    d = base / f"flashckpt-faults-{uuid.uuid4().hex[:12]}" if base.is_dir() else tmp_path / "shm"
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _expected_steps(n_cases: int) -> list[list[int]]:
    """Steps visible after each case: 1, then each case's clean save (3, 5, ...)."""
    return [[1] + [2 * i + 1 for i in range(1, k + 1)] for k in range(n_cases)]


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_one_failure_never_wedges_later_saves(
    ranks: Any, tmp_path: Path, mem_dir: Path, mode: str
) -> None:
    """A raise on any rank at any point: one error everywhere, promptly; the next save works.
    (Before the barriers were keyed by step and attempt, a failure before the save job
    existed left that rank's barrier counter behind and every later save timed out.)"""
    root = str(tmp_path / "ckpt")
    results = ranks.ok(ranks(matrix_job, 2, tmp_path, root, str(mem_dir), RAISE_CASES, mode))
    for i, (case, before) in enumerate(zip(RAISE_CASES, _expected_steps(len(RAISE_CASES)))):
        got = [results[r][i] for r in range(2)]
        check_case(case, got, before)  # "injected failure", not "timeout": nobody waited
    assert cli_main(["verify", root]) == 0  # nothing older was damaged or deleted


def test_hung_rank_gets_the_same_error_and_the_next_save_works(
    ranks: Any, tmp_path: Path, mem_dir: Path
) -> None:
    root = str(tmp_path / "ckpt")
    results = ranks.ok(ranks(matrix_job, 2, tmp_path, root, str(mem_dir), HANG_CASES, "sync"))
    for i, (case, before) in enumerate(zip(HANG_CASES, _expected_steps(len(HANG_CASES)))):
        check_case(case, [results[r][i] for r in range(2)], before)
    assert cli_main(["verify", root]) == 0


def kill_job(rank: int, world: int, root: str, mem: str, case: tuple[int, str, str]) -> Any:
    inj = Injector(rank)
    state = new_state(inj, seed=0)
    with open_ckpt(root, mem) as ckpt:
        instrument(ckpt, inj)
        ckpt.save(1, state)
        bump(state)
        inj.case = case
        if case[1] == "load":
            err, took = outcome(lambda: ckpt.restore(state))
        else:
            err, took = outcome(lambda: ckpt.save(2, state))
        ckpt._closed = True  # a peer is dead: skip close()'s waits, release nothing shared
        return {"error": err, "took": took}


KILL_CASES = [
    (1, "chunks", "kill", 2),
    (0, "state_dict", "kill", 2),
    (0, "publish", "kill", 2),
    (1, "load", "kill", 2),
    (2, "part", "kill", 4),
]


@pytest.mark.parametrize("case", KILL_CASES, ids=lambda c: f"rank{c[0]}-{c[1]}-world{c[3]}")
def test_killed_rank(ranks: Any, tmp_path: Path, mem_dir: Path, case: tuple[Any, ...]) -> None:
    bad, point, how, world = case
    root = str(tmp_path / "ckpt")
    results = ranks(kill_job, world, tmp_path, root, str(mem_dir), (bad, point, how))
    assert results[bad] is None, "the killed rank left no result"
    alive = [r for r in range(world) if r != bad]
    errors = [results[r]["error"] for r in alive]
    assert errors[0] is not None and all(e == errors[0] for e in errors), errors
    message, _, failed = errors[0]
    assert failed == [bad] and "timeout" in message, errors[0]
    assert all(results[r]["took"] < 2 * T + 5 for r in alive)
    for tier, (steps, parts) in visible(root, str(mem_dir)).items():
        assert 2 not in steps, f"{tier}: {steps}"
        assert not parts, f"{tier}: {parts}"
    assert cli_main(["verify", str(mem_dir), "--step", "1"]) == 0


def unknown_job(rank: int, world: int, root: str, mem: str, case: tuple[int, str, str]) -> Any:
    inj = Injector(rank)
    state = new_state(inj, seed=0)
    with open_ckpt(root, mem) as ckpt:
        instrument(ckpt, inj)
        ckpt.save(1, state)
        bump(state)
        inj.case = case
        try:
            ckpt.save(2, state)
            err = None
        except DistributedError as exc:
            err = {"type": type(exc).__name__, "msg": str(exc), "ranks": exc.ranks}
        ckpt._closed = True  # a peer is dead: skip close()'s waits, release nothing shared
        return err


def restore_job(rank: int, world: int, root: str, mem: str) -> Any:
    inj = Injector(rank)
    state = new_state(inj, seed=1)
    with open_ckpt(root, mem) as ckpt:
        return ckpt.restore(state)


@pytest.mark.parametrize(("point", "restored"), [("published", 2), ("publish", 1)])
def test_a_publisher_killed_around_the_manifest_reports_outcome_unknown(
    ranks: Any, tmp_path: Path, mem_dir: Path, point: str, restored: int
) -> None:
    """Rank 0 killed right after (or right before) writing the manifest: rank 1 cannot know
    whether step 2 is committed, so it must not say "nothing was published" (a restart
    restored that step); it raises OutcomeUnknownError, and the restart restores whatever
    the outcome was: step 2 when the manifest landed, step 1 when it did not."""
    root = str(tmp_path / "ckpt")
    results = ranks(unknown_job, 2, tmp_path, root, str(mem_dir), (0, point, "kill"))
    assert results[0] is None, "rank 0 was killed"
    err = results[1]
    assert err is not None and err["type"] == "OutcomeUnknownError", err
    assert "outcome unknown" in err["msg"] and "nothing was published" not in err["msg"], err
    assert err["ranks"] == [0]
    again = ranks.ok(ranks(restore_job, 2, tmp_path / "again", root, str(mem_dir)))
    assert again == [restored, restored]
