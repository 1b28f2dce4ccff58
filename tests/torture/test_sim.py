"""Seeded random operation sequences over a fault-injecting backend (see torture_sim.py)."""

from __future__ import annotations

from pathlib import Path

from torture_faults import FaultPlan, install
from torture_sim import Sim


def test_sim(tmp_path: Path, sim_seed: int) -> None:
    with install(FaultPlan(seed=sim_seed, scope=tmp_path)) as plan:
        sim = Sim(base=tmp_path, seed=sim_seed, plan=plan)
        sim.run()
    for v in sim.known:
        print(f"known bug (torture_known.py): [{v.invariant}] {v.detail}")
