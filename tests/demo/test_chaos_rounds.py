"""The fair chaos run: methods interleaved in rounds (rotating order, one set of kills per
round), aggregate goodput from summed useful and wall time, and busy processes beside it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from flashckpt.demo.chaos_rounds import aggregate, busy_load, rounds_table, run_rounds
from flashckpt.errors import ConfigError


def _fake_run(calls: list, goodput: dict):
    def run(*, out, minutes, mtbf_s, methods, seed, kills, say, **kw):
        calls.append({"methods": list(methods), "kills": list(kills), "minutes": minutes})
        r = len(calls) - 1
        res = {}
        for m in methods:
            g = goodput[m][r]
            res[m] = {"error": "boom"} if g is None else {
                "goodput": g, "wall_s": 100.0 * (r + 1), "useful_s": g * 100.0 * (r + 1),
                "failures": len(kills),
            }  # fmt: skip
        return {"methods": res}

    return run


def test_rounds_rotate_the_order_share_kills_and_sum_useful_over_wall(tmp_path: Path) -> None:
    calls: list = []
    goodput = {"a": [0.9, 0.5, 0.7], "b": [0.8, 0.6, None], "c": [0.1, 0.2, 0.95]}
    res = run_rounds(
        out=tmp_path, minutes=3.0, mtbf_s=20.0, segments=3, methods=["a", "b", "c"],
        say=lambda _m: None, run=_fake_run(calls, goodput),
    )  # fmt: skip
    assert [c["methods"] for c in calls] == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"]]
    assert all(c["minutes"] == pytest.approx(1.0) for c in calls)
    assert len({tuple(c["kills"]) for c in calls}) > 1  # each round draws its own kill offsets
    a = res["methods"]["a"]
    # walls 100, 200, 300: (0.9*100 + 0.5*200 + 0.7*300) / 600, not the mean of the rounds
    assert a["goodput"] == pytest.approx((90 + 100 + 210) / 600)
    assert a["segments"] == [0.9, 0.5, 0.7] and a["spread"] == [0.5, 0.9]
    b = res["methods"]["b"]  # its last round failed: counted out of its goodput, reported
    assert b["goodput"] == pytest.approx((80 + 120) / 300) and b["errors"] == ["boom"]
    assert b["segments"] == [0.8, 0.6, None]
    assert [res["methods"][m]["wins"] for m in "abc"] == [1, 1, 1]
    assert json.loads((tmp_path / "chaos.json").read_text())["methods"] == res["methods"]
    table = rounds_table(res)
    assert "| a | 66.7% | 50.0%-90.0% | 1/3 |" in table and "(1 failed)" in table


def test_aggregate_of_a_method_that_never_ran_is_none() -> None:
    res = aggregate([{"methods": {"a": {"error": "x"}}}], ["a"])
    assert res["methods"]["a"]["goodput"] is None and res["methods"]["a"]["spread"] is None


@pytest.mark.parametrize("kw", [{"segments": 0}, {"segments": 1.5}, {"load": -1}])
def test_bad_segments_or_load_is_a_config_error(tmp_path: Path, kw) -> None:
    args = {"segments": 2, "load": 0, **kw}
    with pytest.raises(ConfigError):
        run_rounds(out=tmp_path, minutes=1, mtbf_s=10, say=lambda _m: None, **args)
    assert not any(tmp_path.iterdir())


def test_busy_load_runs_n_processes_and_stops_them_when_the_block_raises() -> None:
    with pytest.raises(RuntimeError), busy_load(2) as pids:
        assert len(pids) == 2
        for pid in pids:
            os.kill(pid, 0)  # alive
        raise RuntimeError("the run failed")
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def _running(pid: int) -> bool:
    """True while ``pid`` runs (an exited child not yet reaped by its new parent is a zombie)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def test_busy_processes_end_when_the_harness_is_killed() -> None:
    """Regression: a chaos run stopped with SIGTERM (or SIGKILL) left its --load processes
    spinning on the cores forever (the block's cleanup never ran)."""
    parent = subprocess.Popen(
        [sys.executable, "-c",
         "import time\nfrom flashckpt.demo.chaos_rounds import busy_load\n"
         "with busy_load(2) as pids:\n    print(*pids, flush=True)\n    time.sleep(60)\n"],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert parent.stdout is not None
    pids = [int(p) for p in parent.stdout.readline().split()]
    assert len(pids) == 2
    parent.kill()
    parent.wait()
    deadline = time.monotonic() + 10
    alive = set(pids)
    while alive and time.monotonic() < deadline:
        alive = {pid for pid in alive if _running(pid)}
        time.sleep(0.05)
    for pid in alive:  # kill what is left so nothing leaks
        os.kill(pid, 9)
    assert not alive, f"busy processes {sorted(alive)} outlived the harness"


@pytest.mark.timeout(600)
def test_chaos_cli_segments_and_load_run_real_trainers(tmp_path: Path) -> None:
    """`flashckpt chaos --segments 2 --load 1`: two rounds of real trainers killed with SIGKILL,
    a busy process beside them; the JSON has each round and the aggregate."""
    out = tmp_path / "res.json"
    proc = subprocess.run(
        [sys.executable, "-m", "flashckpt.cli", "chaos", "--small", "--segments", "2",
         "--load", "1", "--minutes", "0.8", "--mtbf-s", "12", "--methods", "flashckpt",
         "--threads", "1", "--dir", str(tmp_path / "runs"), "--out", str(out)],
        capture_output=True, text=True, timeout=580,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    res = json.loads(out.read_text())
    assert res["segments"] == 2 and res["load"] == 1 and len(res["rounds"]) == 2
    fc = res["methods"]["flashckpt"]
    assert not fc["errors"] and len(fc["segments"]) == 2
    assert 0.0 < fc["goodput"] < 1.1
    assert (tmp_path / "runs" / "round-1" / "flashckpt" / "train.jsonl").is_file()
    assert "rounds led" in proc.stdout
