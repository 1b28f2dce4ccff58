"""The HTML report: self-contained, escaped, friendly when empty."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from flashckpt.errors import ConfigError
from flashckpt.report import build_report, write_report

EVIL = '<script>alert("x")</script>'
EVIL_ATTR = '"><img src=x onerror=alert(1)>'


def test_report_has_every_chart_and_card(events: list[dict[str, Any]]) -> None:
    html = build_report(events, gpu_hour_price=2.5)
    assert html.count("<svg") == 6
    for title in (
        "Blocking time and time to durable per save",
        "Throughput per save",
        "New vs reused bytes per save",
        "Memory timeline by phase",
        "Checkpoint interval decisions",
        "Failures and lost work",
        "Where the wall time went",
    ):
        assert title in html
    assert "78.0%" in html  # goodput card (see test_summary for the arithmetic)
    assert "raw device" in html and "79% of the raw device" in html
    assert html.count("<rect") > 40 and "<polyline" in html and "<circle" in html
    assert "ENOSPC" in html  # the failed save is listed under incidents


def test_report_is_self_contained(events: list[dict[str, Any]]) -> None:
    html = build_report(events)
    assert "<script" not in html.lower()
    assert not re.search(r"\b(src|href)\s*=", html)
    assert "url(" not in html and "@import" not in html and "@font-face" not in html
    # the only URL is the SVG namespace, which is an identifier, never fetched
    assert set(re.findall(r"https?://[^\s\"'<>]+", html)) == {"http://www.w3.org/2000/svg"}


def test_journal_strings_are_escaped(events: list[dict[str, Any]]) -> None:
    t = events[-1]["t"]
    events += [
        {"t": t + 1, "event": "memory", "phase": EVIL, "allocated_bytes": 1.0},
        {"t": t + 2, "event": "save_failed", "step": 5000, "error": EVIL_ATTR},
        {"t": t + 3, "event": "interval", "policy": EVIL, "interval_s": 9.0, "reason": EVIL_ATTR},
        {"t": t + 4, "event": "corrupt", "step": 7, "tier": EVIL, "error": EVIL},
    ]
    html = build_report(events, gpu_hour_price=1.0)
    assert EVIL not in html and EVIL_ATTR not in html
    assert "<img" not in html and "<script" not in html
    assert "&lt;script&gt;" in html and "&quot;&gt;&lt;img" in html


def test_title_is_escaped(tmp_path: Path) -> None:
    html = build_report([], title=EVIL)
    assert EVIL not in html and "&lt;script&gt;" in html


@pytest.mark.parametrize("content", [None, "", 'not json\n{"t": 1, "ev'])
def test_empty_journal_gives_a_friendly_page(tmp_path: Path, content: str | None) -> None:
    if content is not None:
        (tmp_path / "journal.jsonl").write_text(content)
    html = build_report(tmp_path)
    assert "No journal events yet" in html and "<svg" not in html
    assert html.startswith("<!DOCTYPE html>") and html.rstrip().endswith("</html>")


def test_missing_root_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        build_report(tmp_path / "nope")


def test_write_report_from_root(root: Path, tmp_path: Path) -> None:
    out = write_report(root, output=tmp_path / "sub" / "r.html", gpu_hour_price=3.0)
    text = out.read_text(encoding="utf-8")
    assert out.name == "r.html" and text.count("<svg") == 6
    assert str(root) in text  # the heading names the root


def test_many_saves_and_odd_values_do_not_break_charts(events: list[dict[str, Any]]) -> None:
    t = events[-1]["t"]
    for i in range(600):
        events.append({"t": t + i, "event": "staged", "step": 10_000 + i, "blocking_s": 0.1})
    events.append({"t": t + 700, "event": "durable", "step": 5, "throughput_Bps": "fast"})
    events.append({"t": float("nan"), "event": "staged", "step": 1, "blocking_s": 1.0})
    events.append({"t": t + 800, "event": "interval", "interval_s": None, "policy": "every"})
    html = build_report(events)
    assert html.count("<svg") == 6 and "nan" not in html.lower().replace("nano", "")


def _ticks_s(html: str, chart: str) -> list[float]:
    svg = html.split(f'aria-label="{chart}"', 1)[1].split("</svg>", 1)[0]
    scale = {"ms": 1e-3, "s": 1.0, "min": 60.0, "h": 3600.0, "d": 86_400.0}
    out = []
    for value, unit in re.findall(r'class="tick">([0-9.]+) (ms|s|min|h|d)</text>', svg):
        out.append(float(value) * scale[unit])
    return out


def test_timelines_run_to_the_end_of_the_run(events: list[dict[str, Any]]) -> None:
    t0 = events[0]["t"]
    end = events[-1]["t"] - t0 + 3 * 3600  # three quiet hours after the last incident
    events.append({"t": t0 + end, "event": "run_end", "step": 2000})
    html = build_report(events)
    for chart in ("failures and lost work", "GPU memory by phase", "interval decisions"):
        assert max(_ticks_s(html, chart)) >= 0.8 * end, chart
