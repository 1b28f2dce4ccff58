"""``flashckpt bench --quick``: every method and part runs and lands in the JSON."""

from __future__ import annotations

import json

import pytest

from flashckpt.cli import main
from flashckpt.cli.bench.impl import METHODS


def test_bench_quick_writes_every_method(tmp_path, capsys):
    out = tmp_path / "bench.json"
    work = tmp_path / "work"
    assert main(["bench", "--quick", "--out", str(out), "--dir", str(work)]) == 0
    result = json.loads(out.read_text())
    save = result["save"]["methods"]
    assert set(save) == set(METHODS)
    for name, r in save.items():
        assert r["durable_s"] > 0 and r["blocking_s"] >= 0, name
    assert save["flashckpt_incremental"]["new_bytes"] == 0
    assert save["flashckpt_incremental"]["reused_bytes"] > 0
    assert set(result["loop"]["methods"]) == {"none", "torch_save", "dcp_async_save",
                                              "flashckpt_async"}  # fmt: skip
    assert len(result["rss"]["rss_bytes"]) == 40
    assert result["gil"]["process_exitcode"] == 0
    names = [t["target"] for t in result["targets"]]
    assert any("durable" in n for n in names) and any("RSS" in n for n in names)
    table = capsys.readouterr().out
    assert "| flashckpt_async |" in table and "| target |" in table
    assert list(work.iterdir()) == []  # the run's own directory is removed


def test_bench_rejects_unknown_parts(tmp_path):
    assert main(["bench", "--parts", "save,nope", "--out", str(tmp_path / "x.json")]) == 2


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="CPU-only check")
def test_bench_gpu_without_cuda_is_a_usage_error(tmp_path):
    assert main(["bench", "--gpu", "--quick", "--out", str(tmp_path / "x.json")]) == 2


def test_loop_cost_measures_each_method_against_no_save_runs_and_the_memcpy_floor(tmp_path):
    """benchmarks/loop_cost.py (flashckpt bench --parts loop-cost), tiny: every method runs in a
    fresh process bracketed by no-save runs, and the table shows it beside the memcpy floor."""
    from flashckpt.cli.bench import cost as bench_cost

    said: list[str] = []
    res = bench_cost.run(
        profiles=("dispatch",),
        methods=("torch_save", "flashckpt_memory"),
        state_bytes=4 << 20,
        tensors=8,
        steps=14,
        every=4,
        rounds=2,
        work_dir=str(tmp_path),
        say=said.append,
    )
    prof = res["profiles"]["dispatch"]
    assert len(prof["baselines"]) == 5  # before the first run and after each of 2 x 2 runs
    # the second round runs the methods in the other order
    order = [m.split()[1] for m in said if "ms/save" in m]
    assert order == ["torch_save", "flashckpt_memory", "flashckpt_memory", "torch_save"]
    for name in ("torch_save", "flashckpt_memory"):
        r = prof["methods"][name]
        assert "error" not in r, r
        assert r["saves"] == 2 and r["own_step_s"] > 0
        assert {"cost_s", "own_s", "first_s", "warm_s"} <= set(r)
        assert isinstance(r["wait_s"], float)  # the training thread's run-queue wait (Linux)
        assert len(r["rounds_cost_s"]) == 2 and r["failed_rounds"] == 0
        assert min(r["rounds_cost_s"]) <= r["cost_s"] <= max(r["rounds_cost_s"])
    assert res["memcpy_s"] > 0 and res["memcpy_per_tensor_s"] > 0  # the two floors
    table = bench_cost.table(res)
    floor = f"{res['memcpy_s'] * 1e3:.0f} / {res['memcpy_per_tensor_s'] * 1e3:.0f} ms |"
    assert table.count(floor) == len(res["profiles"])
    assert "| dispatch |" in table and "flashckpt_memory" in table and "memcpy" in table
    assert table.count("..") >= 2  # each method's spread over its rounds
    assert table.count("; waits ") == 2  # what each method's threads took from the loop
    assert list(tmp_path.iterdir()) == []  # the runs' roots are removed


def test_contended_loop_runs_the_threads_the_busy_processes_leave(monkeypatch):
    """The contended profile's loop gets the cores its busy processes leave, at least one; a
    thread per core beside busy processes stalls at every barrier and drowns the save's cost."""
    from flashckpt.cli.bench import cost as bench_cost

    monkeypatch.setattr(bench_cost.os, "cpu_count", lambda: 8)
    assert bench_cost._threads("dispatch", 0) == 1
    assert bench_cost._threads("compute", 0) == 8
    assert bench_cost._threads("contended", 2) == 6
    assert bench_cost._threads("contended", 8) == 1
    assert bench_cost._threads("contended", 12) == 1


def test_the_memcpy_floor_copies_every_byte_whole_or_in_pieces(monkeypatch):
    """The per-tensor floor copies the same bytes in ``pieces`` copies, no byte missed."""
    import numpy as np

    from flashckpt.cli.bench import cost as bench_cost

    copied: list[int] = []
    real = np.copyto

    def copyto(dst, src):
        copied.append(dst.size)
        real(dst, src)

    monkeypatch.setattr(np, "copyto", copyto)
    bench_cost.memcpy_s(1000, repeat=1, pieces=7)
    assert len(copied) == 1 + 7 and sum(copied[1:]) == 1000  # (the first: the warm-up copy)
