"""A realistic synthetic journal: two runs, a crash, saves landing in two tiers, memory phases."""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

T0 = 1_700_000_000.0
STEP_S = 0.5


def make_journal() -> list[dict[str, Any]]:
    rng = random.Random(0)
    ev: list[dict[str, Any]] = []

    def add(t: float, event: str, **kw: Any) -> None:
        ev.append({"t": T0 + t, "event": event, "pid": 100, **kw})

    add(0, "run_start", clean_previous=True)
    add(1, "bench", tier="local", raw_Bps=2.0e9)
    t, step = 2.0, 0
    phases = ("forward", "backward", "optimizer")
    for run in range(2):
        if run == 1:  # crash at step 470, restart, restore 400
            # as RunMarker.start journals them: the crash (with the crashed run's last sign of
            # life, its marker's last tick at step 470), then the new run's start
            add(t + 95, "crash_detected", last_step=step, since_t=T0 + t)
            add(t + 95, "run_start", clean_previous=False)
            add(t + 110, "restore", step=400, tier="memory", seconds=12.0, bytes=3.1e9)
            add(t + 110, "steps_lost", from_step=401, to_step=step, steps=step - 400)
            restart = dict(down_s=0.4, start_s=94.6, restore_s=12.0, first_step_s=0.5)
            add(t + 112.5, "restart", step=401, restart_seconds=107.5, restored_step=400, **restart)
            t, step = t + 112, 400
        for _ in range(470 if run == 0 else 600):
            step += 1
            t += STEP_S
            if step % 50 == 0:
                add(t, "step_time", step=step, seconds=STEP_S)
                for i, ph in enumerate(phases):
                    alloc = (6 + 3 * i + rng.random()) * 2**30
                    add(
                        t + 0.1 * i,
                        "memory",
                        phase=ph,
                        allocated_bytes=alloc,
                        reserved_bytes=14 * 2**30,
                        max_allocated_bytes=alloc * 1.1,
                        fragmentation_bytes=14 * 2**30 - alloc,
                        alloc_retries=0,
                    )
            if step % 100 == 0:
                blocking = 0.3 + 0.2 * rng.random()
                new = 3.1e9 if step == 100 else 4e8 + 2e8 * rng.random()
                add(t, "save_start", step=step)
                add(t + blocking, "staged", step=step, blocking_s=blocking)
                for tier, lag in (("memory", 2.0), ("local", 9.0 + 3 * rng.random())):
                    add(
                        t + blocking + lag,
                        "durable",
                        step=step,
                        tier=tier,
                        background_s=lag,
                        total_bytes=3.1e9,
                        new_bytes=new,
                        reused_bytes=3.1e9 - new,
                        chunks_new=10,
                        chunks_reused=90,
                        throughput_Bps=new / lag * 4,
                    )
                add(
                    t,
                    "interval",
                    policy="auto",
                    interval_s=45.0 + step / 50,
                    interval_steps=90 + step // 25,
                    cost_s=blocking,
                    mtbf_s=3600.0 + step,
                    restart_s=60.0,
                    persist_s=11.0,
                    reason="daly optimum, measured save cost",
                )
                t += blocking
    add(t + 3, "save_failed", step=step + 1, error="ENOSPC: no space left on device")
    add(t + 5, "run_end", step=step)
    return ev


@pytest.fixture(scope="session")
def journal_factory() -> Callable[[], list[dict[str, Any]]]:
    return make_journal


@pytest.fixture
def events() -> list[dict[str, Any]]:
    return make_journal()


@pytest.fixture
def root(tmp_path: Path, events: list[dict[str, Any]]) -> Path:
    r = tmp_path / "ckpt"
    r.mkdir()
    with open(r / "journal.jsonl", "w") as f:
        for e in events:
            f.write(json.dumps(e) + "\n")
    return r
