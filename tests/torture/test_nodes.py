"""The harness's requeue, kill-after-manifest and simulated pids (torture_nodes.py,
torture_procs.py) catch what they are for: each scenario runs through the simulation's own
operations, once against the library as it is and once against a deliberately broken one."""

from __future__ import annotations

import dataclasses
import errno
from pathlib import Path
from typing import Any

import pytest
from torture_faults import FaultPlan, install
from torture_oracle import ViolationError, disk_steps, manifest_path
from torture_procs import simulated_pids
from torture_sim import Sim

import flashckpt.engine.restore.lineage as engine_lineage
from flashckpt.errors import StorageError
from flashckpt.store import pins
from flashckpt.store.files.backend import LocalBackend

pytestmark = pytest.mark.usefixtures("own_counts")  # conftest.py


def _sim(tmp_path: Path, plan: FaultPlan, *, memory: bool) -> Sim:
    sim = Sim(base=tmp_path, seed=5, plan=plan, ops=0, faults=False)
    sim.cfg = dataclasses.replace(
        sim.cfg,
        memory=memory,
        async_save=False,
        keep=3,
        keep_memory=3,
        incremental=True,
        promote_every=1,
    )
    sim.nodes = [tmp_path / "node0-mem", tmp_path / "node1-mem"] if memory else []
    sim.mem = sim.nodes[0] if memory else None
    return sim


def _save(sim: Sim, step: int) -> None:
    sim.next_step = step
    sim.op_save(clean=True)
    sim.check()


def _requeue_scenario(tmp_path: Path) -> Sim:
    """Run 1 on node 0 saves 0 and 1 (promoted to disk), then 2, whose promotion fails, and
    dies; run 2 on node 1 restores 1 and saves 2 again (durable on disk); run 3 lands back on
    node 0, where run 1's copy of step 2 still is, and restores."""
    with install(FaultPlan(seed=5, scope=tmp_path)) as plan, simulated_pids(plan) as pids:
        sim = _sim(tmp_path, plan, memory=True)
        sim.pids = pids
        pids.start(plan.generation)
        root = str(sim.root)

        def no_promotion_of_2(method: str, backend: LocalBackend, path: str) -> None:
            if method == "put" and str(backend.root) == root and path == manifest_path(2):
                raise StorageError(f"could not write {path}: {errno.EIO} (test)")

        try:
            sim.op_reopen(clean=True)
            _save(sim, 0)
            _save(sim, 1)
            plan.sabotage = no_promotion_of_2
            _save(sim, 2)
            assert 2 in disk_steps(sim.nodes[0]) and 2 not in disk_steps(sim.root)
            sim.op_crash(clean=True)
            plan.sabotage = None
            sim.requeue_onto(sim.nodes[1], clean=True)
            assert sim.next_step == 2, sim.log[-3:]
            _save(sim, 2)
            sim.op_crash(clean=True)
            sim.requeue_onto(sim.nodes[0], clean=True)
            sim.check()
        finally:
            sim.shutdown()
    return sim


def test_a_requeue_onto_the_old_node_restores_the_later_runs_step(tmp_path: Path) -> None:
    sim = _requeue_scenario(tmp_path)
    assert sim.next_step == 3, sim.log[-4:]  # run 3 restored step 2: run 2's (checked bitwise)
    assert len(sim.records[2]) == 2  # two runs saved step 2, with different bytes


def test_oracle_catches_a_restore_by_tier_order_after_a_requeue(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A library that picks each step's copy by tier order (memory first) hands run 3 run 1's
    abandoned copy of step 2: the oracle must call it a wrong restore."""
    monkeypatch.setenv("FLASHCKPT_TORTURE_STRICT", "1")

    def tier_order(held: Any, store_of: Any) -> Any:
        _, verdict = real(held, store_of)
        return {s: list(hs) for s, hs in held.items()}, dataclasses.replace(verdict, verdicts={})

    real = engine_lineage.judge_held
    monkeypatch.setattr(engine_lineage, "judge_held", tier_order)
    with pytest.raises(ViolationError) as err:
        _requeue_scenario(tmp_path)
    assert err.value.violation.invariant == "restore_wrong_data", err.value


def test_a_kill_right_after_the_manifest_leaves_an_unknown_step_that_restores(
    tmp_path: Path,
) -> None:
    with install(FaultPlan(seed=5, scope=tmp_path)) as plan, simulated_pids(plan) as pids:
        sim = _sim(tmp_path, plan, memory=False)
        sim.pids = pids
        pids.start(plan.generation)
        try:
            sim.op_reopen(clean=True)
            _save(sim, 0)
            sim.next_step = 1
            sim.op_kill_after_manifest(clean=True)
            assert 1 in disk_steps(sim.root), "the manifest was published before the kill"
            assert sim.outcome[(1, sim.run_gen)] == "unknown"  # the save did not report ok
            sim.check()
            sim.op_reopen(clean=True)
            assert sim.check_restore_newest(clean=True) == 1  # bitwise as saved (checked)
        finally:
            sim.shutdown()


def test_a_torn_pin_of_a_crashed_simulated_process_does_not_stop_gc(tmp_path: Path) -> None:
    """Seed 13 of the 10,000-operation run: a pin torn at its final name by a simulated process
    that then crashed made every later gc refuse, because the pin carried the test's own pid
    (alive). Each simulated process now has a pid of its own, gone when it crashes."""
    with install(FaultPlan(seed=5, scope=tmp_path)) as plan, simulated_pids(plan) as pids:
        sim = _sim(tmp_path, plan, memory=False)
        sim.pids = pids
        pids.start(plan.generation)
        try:
            sim.op_reopen(clean=True)
            _save(sim, 0)
            rec = pins.new_record(kind="save", step=1)
            (sim.root / "pins").mkdir(exist_ok=True)
            (sim.root / rec.path).write_bytes(rec.to_json()[:9])  # torn at its final name
            sim.op_crash(clean=True)
            sim.op_gc(clean=True)  # fails with gc_refused_while_idle if the pin looks alive
            assert not (sim.root / rec.path).exists()
        finally:
            sim.shutdown()
