"""Prometheus textfile and HTTP endpoint, TensorBoard scalars."""

from __future__ import annotations

import sys
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from flashckpt.errors import ConfigError
from flashckpt.report import (
    PrometheusExporter,
    TensorBoardSink,
    exposition,
    summarize,
    write_prometheus_textfile,
)


def _values(text: str) -> dict[str, float]:
    return {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_textfile_is_valid_exposition(tmp_path: Path, events: list[dict[str, Any]]) -> None:
    summary = summarize(events, gpu_hour_price=2.0)
    out = write_prometheus_textfile(tmp_path / "prom" / "flashckpt.prom", summary)
    values = _values(out.read_text())
    assert values["flashckpt_saves_total"] == 10
    assert values["flashckpt_crashes_total"] == 1 and values["flashckpt_steps_lost_total"] == 70
    assert values["flashckpt_goodput_ratio"] == pytest.approx(summary.goodput)
    assert values["flashckpt_cost_total"] == pytest.approx(summary.cost)
    assert [p.name for p in out.parent.iterdir()] == ["flashckpt.prom"]  # no temp file left


def test_textfile_from_root_and_empty(tmp_path: Path, root: Path) -> None:
    assert _values(exposition(root))["flashckpt_saves_total"] == 10
    values = _values(exposition([]))
    assert values["flashckpt_saves_total"] == 0 and "flashckpt_goodput_ratio" not in values


def test_textfile_needs_prom_suffix(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"\.prom"):
        write_prometheus_textfile(tmp_path / "metrics.txt", [])


def test_http_exporter_serves_current_numbers(root: Path) -> None:
    with PrometheusExporter(root, port=0, addr="127.0.0.1") as exp:
        url = f"http://127.0.0.1:{exp.port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as resp:
            values = _values(resp.read().decode())
        assert values["flashckpt_saves_total"] == 10
        with open(root / "journal.jsonl", "a") as f:  # re-read on every scrape
            f.write('{"t": 1700009999.0, "event": "staged", "step": 5000, "blocking_s": 1.0}\n')
        with urllib.request.urlopen(url, timeout=10) as resp:
            assert _values(resp.read().decode())["flashckpt_saves_total"] == 11


def test_exporter_without_prometheus_client_names_the_extra(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "prometheus_client", None)
    with pytest.raises(ConfigError, match=r"flashckpt\[metrics\]"):
        PrometheusExporter(root)


def test_exporter_rejects_bad_port(root: Path) -> None:
    with pytest.raises(ConfigError, match="port"):
        PrometheusExporter(root, port=70_000)


def test_tensorboard_scalars(tmp_path: Path, events: list[dict[str, Any]]) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with TensorBoardSink(tmp_path / "tb") as sink:
        assert sink.add_saves(events) == 10
        sink.add_summary(summarize(events, gpu_hour_price=1.0), step=1000)
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"flashckpt/goodput", "flashckpt/save/blocking_s", "flashckpt/cost"} <= tags
    blocking = acc.Scalars("flashckpt/save/blocking_s")
    assert [s.step for s in blocking] == list(range(100, 1001, 100))
    assert acc.Scalars("flashckpt/goodput")[0].value == pytest.approx(0.780, abs=0.01)


def test_tensorboard_missing_is_a_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with pytest.raises(ConfigError, match="tensorboard"):
        TensorBoardSink(tmp_path / "tb")
