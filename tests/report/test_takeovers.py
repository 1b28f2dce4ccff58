"""Restarts a warm standby took over are counted and shown apart from cold ones: the summary,
``flashckpt status``'s text, the HTML report's restart card and the Prometheus exporter."""

from __future__ import annotations

import pytest

from flashckpt.report.html import _restart_note
from flashckpt.report.prometheus import exposition
from flashckpt.report.summary import summarize
from flashckpt.report.terminal import format_status

COLD = {"t": 20.0, "event": "restart", "restart_seconds": 9.0, "down_s": 0.5, "start_s": 5.0,
        "restore_s": 0.5, "first_step_s": 3.0}  # fmt: skip
WARM = {"t": 40.0, "event": "restart", "restart_seconds": 1.0, "down_s": 0.1, "start_s": 0.05,
        "restore_s": 0.45, "first_step_s": 0.4, "takeover": True, "wait_s": 0.1,
        "open_s": 0.05}  # fmt: skip


def events() -> list[dict]:
    return [
        {"t": 0.0, "event": "run_start", "clean_previous": True},
        {**COLD},
        {"t": 30.0, "event": "takeover", "woke_t": 29.9, "open_s": 0.05},
        {**WARM},
        {**WARM, "t": 50.0, "restart_seconds": 2.0},
    ]


def test_summary_counts_takeovers_apart() -> None:
    s = summarize(events())
    assert s.restarts_timed == 3 and s.takeovers == 2 and s.last_restart_takeover
    assert s.mean_takeover_s == pytest.approx(1.5)
    assert s.mean_cold_restart_s == pytest.approx(9.0)


def test_status_and_report_name_the_standby_parts() -> None:
    s = summarize(events())
    text = format_status(s, root="r")
    assert "2 by a warm standby (mean 1.5 s), 1 cold (mean 9 s)" in text
    assert "(wait 100 ms · open 50 ms · restore 450 ms" in text
    note = _restart_note(s)
    assert "warm standby" in note and "wait" in note


def test_cold_restarts_only_say_nothing_of_standbys() -> None:
    s = summarize(events()[:2])
    assert s.takeovers == 0 and s.mean_takeover_s is None
    assert "standby" not in format_status(s, root="r")
    assert "flashckpt_takeover_seconds_mean" not in exposition(s)


def test_prometheus_exports_takeovers() -> None:
    text = exposition(summarize(events()))
    lines = dict(
        line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#")
    )
    assert float(lines["flashckpt_takeovers_total"]) == 2
    assert float(lines["flashckpt_takeover_seconds_mean"]) == pytest.approx(1.5)
    assert float(lines["flashckpt_cold_restart_seconds_mean"]) == pytest.approx(9.0)
