"""``flashckpt bench --quick``: every method and part runs and lands in the JSON."""

from __future__ import annotations

import json

import pytest

from flashckpt.cli import main
from flashckpt.cli.bench_impl import METHODS


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
