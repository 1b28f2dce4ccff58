"""Journal readers survive any JSON value: status, status --json, report and the Prometheus
exposition never crash on a line a writer did not produce (a 401-digit step, t = +-1e308, NaN,
wrong types); the exporter reads the journal incrementally and listens on 127.0.0.1."""

from __future__ import annotations

import contextlib
import io
import json
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from flashckpt.cli import main
from flashckpt.journal import JournalTail, read_events
from flashckpt.report import summary as summary_mod
from flashckpt.report.prometheus import PrometheusExporter, exposition

pytestmark = pytest.mark.timeout(300)

FIELDS = [
    "t",
    "step",
    "last_step",
    "pid",
    "rank",
    "seconds",
    "blocking_s",
    "background_s",
    "total_bytes",
    "new_bytes",
    "throughput_Bps",
    "restart_seconds",
    "interval_s",
    "steps",
    "tier",
    "error",
]
EVENTS = ["run_start", "save_start", "staged", "durable", "restore", "crash_detected",
          "steps_lost", "restart", "step_time", "interval", "memory", "run_end"]  # fmt: skip

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(10**401), max_value=10**401)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=8),
    lambda kids: (
        st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=4), kids, max_size=3)
    ),
    max_leaves=6,
)


def _base(t: float) -> list[dict[str, Any]]:
    return [
        {"t": t, "event": "run_start", "pid": 1, "clean_previous": True},
        {"t": t + 1, "event": "save_start", "pid": 1, "step": 10},
        {"t": t + 1.1, "event": "staged", "pid": 1, "step": 10, "blocking_s": 0.1},
        {"t": t + 2, "event": "durable", "pid": 1, "step": 10, "tier": "local",
         "background_s": 0.9, "total_bytes": 100, "new_bytes": 100, "reused_bytes": 0},
    ]  # fmt: skip


def _write(root: Path, hostile: dict[str, Any]) -> None:
    root.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps(e) for e in _base(1.7e9)]
    lines.append(json.dumps(hostile, allow_nan=True))
    (root / "journal.jsonl").write_text("\n".join(lines) + "\n")


def _run(argv: list[str]) -> tuple[int, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(argv)
    return rc, out.getvalue() + err.getvalue()


def _check_every_reader(root: Path, tmp: Path) -> None:
    for argv in (["status", str(root)], ["status", str(root), "--json"]):
        rc, text = _run(argv)
        assert rc == 0, text
        assert "Traceback" not in text
    rc, text = _run(["report", str(root), "-o", str(tmp / "r.html")])
    assert rc == 0, text
    text = exposition(root)
    assert "flashckpt_saves_total" in text
    for line in text.splitlines():
        if not line.startswith("#"):
            float(line.rsplit(" ", 1)[1])  # every sample is a number Prometheus parses


NAMED = [
    {"t": 1.7e9 + 3, "event": "save_start", "pid": 1, "step": int("9" * 401)},
    {"t": 1e308, "event": "durable", "pid": 1, "step": 11},
    {"t": -1e308, "event": "restore", "pid": 1, "step": 10},
    {"t": 1.7e9 + 3, "event": "staged", "pid": 1, "step": 11, "blocking_s": float("nan")},
    {"t": 1.7e9 + 3, "event": "restart", "pid": 1, "restart_seconds": 10**401},
    {"t": 1.7e9 + 3, "event": "step_time", "pid": 1, "step": 12, "seconds": float("inf")},
    {"t": 1.7e9 + 3, "event": "crash_detected", "pid": 1, "last_step": -(10**30)},
    {"t": 1.7e9 + 3, "event": "durable", "pid": 1, "step": 12, "total_bytes": 1e308,
     "new_bytes": "x", "background_s": [1]},
]  # fmt: skip


@pytest.mark.parametrize("line", NAMED, ids=range(len(NAMED)))
def test_named_hostile_values_are_survived_by_every_reader(tmp_path, line):
    root = tmp_path / "root"
    _write(root, line)
    _check_every_reader(root, tmp_path)


@settings(
    max_examples=40,
    derandomize=True,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    event=st.sampled_from(EVENTS),
    values=st.dictionaries(st.sampled_from(FIELDS), json_values, max_size=5),
)
@example(event="save_start", values={"step": 10**400})
def test_any_json_value_in_any_field_is_survived(tmp_path, event, values):
    root = tmp_path / "root"
    line = {"t": 1.7e9 + 5, "event": event, "pid": 1, **values}
    _write(root, line)
    _check_every_reader(root, tmp_path)


# -- the exporter -----------------------------------------------------------------------------
def _journal(path: Path, n: int, *, start: int = 0) -> None:
    with open(path, "a") as f:
        for i in range(start, start + n):
            f.write(f'{{"t":{1.7e9 + i},"event":"step_time","pid":1,"step":{i},"seconds":0.1}}\n')


def test_a_scrape_parses_and_folds_only_what_was_appended(tmp_path):
    """A scrape of a 300k-event journal took 15 s: every scrape parsed the whole journal
    again, then every scrape that found a new line summarized all 300k events again. Now a
    scrape parses the new lines only and folds only those into the summary."""
    root = tmp_path / "root"
    root.mkdir()
    _journal(root / "journal.jsonl", 300_000)
    exp = PrometheusExporter(root, port=0)
    first = exp.summary()
    assert exp.tail.lines_parsed == 300_000 and first.last_step == 299_999
    assert exp.fold.folded == 300_000
    assert exp.summary() is first  # nothing new: no line parsed, nothing folded
    assert exp.tail.lines_parsed == 300_000 and exp.fold.folded == 300_000
    _journal(root / "journal.jsonl", 5, start=300_000)
    now = exp.summary()
    assert now.last_step == 300_004
    assert exp.tail.lines_parsed == 300_005 and exp.fold.folded == 300_005
    assert now == summary_mod.summarize(read_events(root))


def test_the_fold_in_pieces_is_the_summary_of_the_whole(tmp_path):
    """Random journals (several runs, crashes, saves on two ranks, restores, lines a little
    out of time order) folded in random pieces give exactly the summary of all the events."""
    import random

    names = [
        "run_start",
        "crash_detected",
        "run_end",
        "step",
        "step_time",
        "save_start",
        "staged",
        "durable",
        "save_failed",
        "restore",
        "steps_lost",
        "restart",
        "interval",
        "governor",
        "corrupt",
        "save_skipped",
        "scrub_damage",
        "abandoned_copy",
        "scrubbed",
    ]
    for seed in range(40):
        rng = random.Random(seed)
        t, events = 1.7e9, []
        for _ in range(rng.randrange(1, 300)):
            t += rng.uniform(-0.5, 3.0)  # now and then a line older than the one before
            e = {
                "event": rng.choice(names),
                "t": t,
                "pid": rng.choice([1, 2]),
                "rank": rng.choice([None, 0, 0, 1]),
                "step": rng.randrange(0, 60),
            }
            e.update(
                seconds=rng.uniform(0, 2),
                blocking_s=rng.uniform(0, 1),
                new_bytes=rng.randrange(1000),
                tier=rng.choice(["memory", "local"]),
                background_s=rng.uniform(0, 2),
                restart_seconds=rng.uniform(0, 9),
                last_step=rng.randrange(60),
                steps=rng.randrange(5),
                bytes=rng.randrange(1 << 20),
                chunks=rng.randrange(9),
            )
            if rng.random() < 0.3:
                e["node"] = rng.choice(["n0", "n1"])
            events.append(e)
        fold, at = summary_mod.JournalFold(), 0
        while at < len(events):
            step = rng.randrange(1, 40)
            fold.extend(events[at : at + step])
            at += step
            assert fold.summary() == summary_mod.summarize(events[:at]), (seed, at)
        assert fold.save_records() == summary_mod.save_records(events)


def test_tail_keeps_a_torn_line_until_it_is_complete_and_rereads_a_replaced_journal(tmp_path):
    p = tmp_path / "journal.jsonl"
    _journal(p, 3)
    tail = JournalTail(p)
    assert tail.poll() == 3
    with open(p, "a") as f:
        f.write('{"t":1.8e9,"event":"run_end",')
    assert tail.poll() == 0
    with open(p, "a") as f:
        f.write('"pid":1}\n')
    assert tail.poll() == 1 and tail.events[-1]["event"] == "run_end"
    assert tail.events == read_events(p)
    p.unlink()
    _journal(p, 2)
    assert tail.poll() == 2 and len(tail.events) == 2  # a new journal is read from its start


def test_exporter_listens_on_localhost_unless_told_otherwise(tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    _journal(root / "journal.jsonl", 3)
    with PrometheusExporter(root, port=0) as exp:
        assert exp.addr == "127.0.0.1"
        assert exp._server.server_address[0] == "127.0.0.1"
        body = urllib.request.urlopen(f"http://127.0.0.1:{exp.port}/metrics", timeout=10).read()
    assert b"flashckpt_last_step 2.0" in body
