"""Issue 27: the report, ``flashckpt status`` and the metrics show what the idle scrub found
(``scrub_damage``), what it verified (``scrubbed``) and the checkpoint copies lineage abandoned
(``abandoned_copy``), counted from every rank the way report/tierhealth.py says."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest

from flashckpt.cli import main as cli_main
from flashckpt.report import build_report
from flashckpt.report.prometheus import exposition
from flashckpt.report.summary import JournalFold, summarize

CHUNK_0 = "a0" * 16
CHUNK_1 = "b1" * 16


def _tier_events(t: float) -> list[dict[str, Any]]:
    """Rank 0 scrubs the disk and node 0's tier, rank 1 node 1's; a disk copy abandoned is
    journaled by both ranks, node 1's copy by node 1's leader only."""

    def ev(dt: float, event: str, rank: int, **kw: Any) -> dict[str, Any]:
        return {"t": t + dt, "event": event, "pid": 100 + rank, "rank": rank, **kw}

    damage = dict(steps=[3], error="hash mismatch", quarantined=True)
    copy = dict(generation=1, newest_generation=2, verdict="abandoned")
    return [
        ev(1, "scrub_damage", 0, tier="local", chunk=CHUNK_0, **damage),
        ev(2, "scrub_damage", 1, tier="memory", chunk=CHUNK_1, **damage),
        ev(3, "abandoned_copy", 0, step=6, tier="local", removed=False, **copy),
        ev(3, "abandoned_copy", 1, step=6, tier="local", removed=False, **copy),
        ev(4, "abandoned_copy", 1, step=5, tier="memory", node="n1", removed=True, **copy),
        ev(5, "scrubbed", 0, tier="local", bytes=3 << 20, chunks=3, seconds=0.1),
        ev(6, "scrubbed", 1, tier="memory", bytes=1 << 20, chunks=1, seconds=0.1),
    ]


def _with_tiers(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    t = max(e["t"] for e in events)
    return [*events[:-1], *_tier_events(t - 100), events[-1]]


def test_the_summary_counts_every_ranks_tier_events_once(events: list[dict[str, Any]]) -> None:
    before = summarize(events)
    assert (before.scrub_damage, before.abandoned_copies, before.scrubbed_bytes) == (0, 0, 0)
    s = summarize(_with_tiers(events))
    assert s.scrub_damage == 2  # node 1's found by rank 1 counts
    assert s.abandoned_copies == 2  # the disk copy once (rank 0's), node 1's once
    assert s.scrubbed_bytes == 4 << 20 and s.scrubbed_chunks == 4


def test_the_report_shows_them(events: list[dict[str, Any]]) -> None:
    html = build_report(_with_tiers(events))
    plain = build_report(events)
    assert "scrub damage" in html and "scrub damage" not in plain  # the timeline's markers
    assert "abandoned copy" in html and "abandoned copy" not in plain
    assert "found 2 damaged chunk(s) (4 MiB verified); 2 checkpoint copies" in html  # caption
    assert CHUNK_1 in html, "rank 1's damage in node 1's tier is listed under incidents"
    assert html.count("<td>abandoned_copy</td>") == 2
    assert html.count("<td>scrub_damage</td>") == 2


def test_status_and_metrics_show_them(
    tmp_path: Path, events: list[dict[str, Any]], capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "ckpt"
    root.mkdir()
    (root / "journal.jsonl").write_text("".join(json.dumps(e) + "\n" for e in _with_tiers(events)))
    assert cli_main(["status", str(root)]) == 0
    out = capsys.readouterr().out
    assert "tiers     2 damaged chunk(s) found by the scrub (4 MiB verified)" in out
    assert "2 abandoned checkpoint copies skipped" in out
    assert cli_main(["status", str(root), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert (data["scrub_damage"], data["abandoned_copies"]) == (2, 2)
    text = exposition(root)
    assert "flashckpt_scrub_damage_total 2.0" in text
    assert "flashckpt_abandoned_copies_total 2.0" in text
    assert f"flashckpt_scrubbed_bytes_total {float(4 << 20)!r}" in text


def test_the_fold_in_pieces_equals_the_batch_answer(events: list[dict[str, Any]]) -> None:
    evs = _with_tiers(events)
    for seed in range(5):
        rng = random.Random(seed)
        fold, at = JournalFold(), 0
        while at < len(evs):
            n = rng.randrange(1, 400)
            fold.extend(evs[at : at + n])
            at += n
            want = summarize(evs[:at])
            got = fold.summary()
            assert (got.scrub_damage, got.abandoned_copies, got.scrubbed_bytes) == (
                want.scrub_damage,
                want.abandoned_copies,
                want.scrubbed_bytes,
            )
            assert got == want
