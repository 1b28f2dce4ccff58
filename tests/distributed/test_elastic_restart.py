"""``torchrun --max-restarts``: a killed job is restarted in place and resumes from memory.

Real torchrun, real SIGKILL, 1 and 2 gloo ranks. ``flashckpt.distributed.init_process_group`` is
what makes the second attempt's gloo rendezvous work (see distributed/group/elastic.py for the torch
bug).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

WORKER = Path(__file__).resolve().parents[1] / "scripts" / "elastic_worker.py"


def _worker() -> object:
    spec = importlib.util.spec_from_file_location("elastic_worker", WORKER)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _straight(steps: int) -> list[list[float]]:
    w = _worker()
    model, opt = w.build()  # type: ignore[attr-defined]
    for step in range(1, steps + 1):
        w.train_step(model, opt, step, 1)  # type: ignore[attr-defined]
    return w.params(model)  # type: ignore[attr-defined, no-any-return]


def _torchrun(nproc: int, tmp: Path, *, steps: int, kill: int) -> list[dict]:
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        f"--nproc_per_node={nproc}", "--max-restarts=1", "--monitor-interval=0.2",
        str(WORKER), str(tmp / "root"), str(tmp / "shm"), str(tmp / "out"), str(steps), str(kill),
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return [json.loads((tmp / f"out.{r}.json").read_text()) for r in range(nproc)]


@pytest.mark.dist
@pytest.mark.parametrize("nproc", [pytest.param(1, marks=pytest.mark.slow), 2])  # 17 s each
def test_torchrun_max_restarts_resumes_in_place_from_memory(tmp_path: Path, nproc: int) -> None:
    expected = _straight(6)
    for r, got in enumerate(_torchrun(nproc, tmp_path, steps=6, kill=3)):
        # the second attempt of the same torchrun resumed from the step saved before the kill
        assert got["attempt"] == 1, (r, got)
        assert got["start"] == 3, (r, got)
        assert got["params"] == expected  # bitwise: JSON floats round-trip exactly
