"""The harness catches a broken store: deliberately broken deletes must fail the oracle.

Each test breaks the store on purpose (through the fault layer's sabotage hook, so nothing in
the library is edited), runs a trial without injected faults in strict mode, and expects the
oracle to report the violated invariant.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import shutil
from pathlib import Path
from typing import Any

import pytest
from torture_faults import FaultPlan, damage_in_place, flip_bit, install
from torture_kill import KillSession
from torture_model import build, train_step
from torture_oracle import ViolationError, disk_steps, manifest_path
from torture_sim import Sim

import flashckpt
from flashckpt.store.files.backend import LocalBackend

pytestmark = pytest.mark.usefixtures("own_counts")  # conftest.py


def _newest_chunk(root: Path) -> Path | None:
    steps = disk_steps(root)
    if not steps:
        return None
    doc = json.loads((root / manifest_path(steps[-1])).read_bytes())
    h = doc["chunks"][0][0]
    return root / "chunks" / h[:2] / h


def _trial(tmp_path: Path, sabotage: Any, *, keep: int) -> ViolationError:
    with install(FaultPlan(seed=3, scope=tmp_path)) as plan:
        sim = Sim(base=tmp_path, seed=3, plan=plan, ops=50, faults=False)
        sim.cfg = dataclasses.replace(sim.cfg, keep=keep, memory=False, async_save=False)
        sim.mem = None
        plan.sabotage = sabotage
        with pytest.raises(ViolationError) as err:
            sim.run()
    return err.value


def test_oracle_catches_gc_deleting_a_referenced_chunk(tmp_path: Path, monkeypatch) -> None:
    """A 'gc' that, with every retention delete, also removes a chunk of the newest step."""
    monkeypatch.setenv("FLASHCKPT_TORTURE_STRICT", "1")

    def broken_gc(method: str, backend: LocalBackend, path: str) -> None:
        if method == "delete" and path.startswith("steps/"):
            victim = _newest_chunk(backend.root)
            if victim is not None and victim.exists():
                os.unlink(victim)

    err = _trial(tmp_path, broken_gc, keep=1)
    assert err.violation.invariant in ("retained_step_damaged", "restore_raised"), err


def test_oracle_catches_retention_deleting_a_kept_step(tmp_path: Path, monkeypatch) -> None:
    """A retention that deletes the oldest kept manifest along with the one it drops."""
    monkeypatch.setenv("FLASHCKPT_TORTURE_STRICT", "1")

    def broken_retention(method: str, backend: LocalBackend, path: str) -> None:
        if method == "delete" and path.startswith("steps/"):
            kept = [s for s in disk_steps(backend.root) if manifest_path(s) != path]
            if len(kept) >= 2:
                (backend.root / manifest_path(kept[0])).unlink(missing_ok=True)

    err = _trial(tmp_path, broken_retention, keep=3)
    assert err.violation.invariant == "retained_step_missing", err


def test_kill_checker_catches_a_damaged_committed_step(tmp_path: Path, monkeypatch) -> None:
    """The checker that runs after each SIGKILL flags a committed step whose chunk rotted."""
    monkeypatch.setenv("FLASHCKPT_TORTURE_STRICT", "1")
    session = KillSession(base=tmp_path, seed=0)
    state = build()
    with flashckpt.Checkpointer(session.root, keep=3, chunk_size="64KiB") as ckpt:
        for step in range(3):
            train_step(state, step)
            ckpt.save(step, state)
    chunk = _newest_chunk(session.root)
    assert chunk is not None
    flip_bit(chunk, random.Random(0))
    try:
        with pytest.raises(ViolationError) as err:
            session.check_after_kill()
    finally:
        shutil.rmtree(session.mem, ignore_errors=True)
    assert err.value.violation.invariant in ("restore_not_newest", "retained_step_damaged")


def test_unbroken_store_passes_the_same_trial(tmp_path: Path, monkeypatch) -> None:
    """Control: the same trial without sabotage reports nothing (so the two above fail
    because of the sabotage, not because of the trial)."""
    monkeypatch.setenv("FLASHCKPT_TORTURE_STRICT", "1")
    with install(FaultPlan(seed=3, scope=tmp_path)) as plan:
        sim = Sim(base=tmp_path, seed=3, plan=plan, ops=50, faults=False)
        sim.cfg = dataclasses.replace(sim.cfg, keep=1, memory=False, async_save=False)
        sim.mem = None
        sim.run()
    assert sim.op == 49 and not sim.known


def test_faults_are_a_pure_function_of_the_seed(tmp_path: Path) -> None:
    """Two plans with the same seed inject the same faults, whatever the call order."""
    calls = [
        (k, m, f"chunks/{i:02x}/x")
        for i in range(50)
        for k, m in (("eio_read", "read"), ("torn", "put"))
    ]
    draws = []
    for order in (calls, calls[::-1]):
        plan = FaultPlan(seed=11, scope=tmp_path)
        plan.begin_op(4, {"eio_read": 0.3, "torn": 0.3})
        draws.append({c: plan.draw(*c) for c in order})
    assert draws[0] == draws[1] and any(draws[0].values()) and not all(draws[0].values())


def _size_only_find(self: Any, h: str, size: int | None = None) -> Any:
    """The reuse rule before issue 27: present and of the right size is enough."""
    from flashckpt.store.format.manifest import ChunkRef
    from flashckpt.store.format.names import chunk_path

    with self.mutex:
        ref = None if h in self.quarantined else self.index().get(h)
        if ref is None or self.root is None:
            return ref
        try:
            at_rest = self.backend.size(chunk_path(h, ref.codec))
        except (OSError, flashckpt.FlashCkptError):
            return None
        if size is not None and ref.codec == "raw" and at_rest != size:
            return None
        raw = size if size is not None else ref.size
        return ChunkRef(hash=h, size=raw, codec=ref.codec, stored_size=at_rest)


@pytest.mark.parametrize("broken", [True, False])
def test_oracle_catches_a_step_reusing_a_chunk_damaged_in_place(
    tmp_path: Path, monkeypatch, broken: bool
) -> None:
    """Issue 27: a chunk damaged in place (same size) before a save and reused by it makes
    that step damaged; the ``inplace`` taint excuses only the steps committed before it, so
    the oracle fails the size-only reuse rule and passes the library's (the control)."""
    monkeypatch.setenv("FLASHCKPT_TORTURE_STRICT", "1")
    if broken:
        from flashckpt.store.liveness import Liveness

        monkeypatch.setattr(Liveness, "find", _size_only_find)
    with install(FaultPlan(seed=5, scope=tmp_path)) as plan:
        sim = Sim(base=tmp_path, seed=5, plan=plan, ops=4, faults=False)
        sim.cfg = dataclasses.replace(
            sim.cfg, keep=3, memory=False, async_save=False, incremental=True
        )
        sim.mem = None
        sim.mutate = lambda step: None  # type: ignore[method-assign]  # every chunk reusable
        try:
            sim.op_reopen(clean=True)
            sim.op = 1
            sim.op_save(clean=True)
            sim.check()
            sim.op = 2
            victim = _newest_chunk(sim.root)
            assert victim is not None
            damage_in_place(victim, random.Random(0))
            plan.taint("inplace", sim.root, str(victim.relative_to(sim.root)))
            sim.op = 3
            sim.op_save(clean=True)
            if broken:
                with pytest.raises(ViolationError) as err:
                    sim.check()
                assert err.value.violation.invariant == "retained_step_damaged", err
            else:
                sim.check()
                assert len(sim.outcome) == 2 and all(v == "ok" for v in sim.outcome.values())
        finally:
            sim.shutdown()
