"""Safe JSON everywhere: depth and size bombs in tiers.json, journal lines and the run marker
give a clean FlashCkptError or a skipped line, never RecursionError or a crash."""

from __future__ import annotations

import contextlib
import io
import json

import pytest

import flashckpt
from flashckpt.cli import main
from flashckpt.journal import Journal, read_events
from flashckpt.policy import Auto
from flashckpt.store.files.jsonfile import load_json
from hostile.util import small_state

pytestmark = pytest.mark.timeout(60)
BOMB = "[" * 200_000 + "]" * 200_000
DEEP_OK_FOR_PARSER = "[" * 900 + "]" * 900  # parses, but would crash a recursive walker


def _run(*args: str) -> tuple[int, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(list(args))
    return rc, out.getvalue() + err.getvalue()


def _root_with_journal(tmp_path, *lines: str):
    root = tmp_path / "root"
    with flashckpt.Checkpointer(root) as ckpt:
        ckpt.save(1, small_state(1.0))
    with open(root / "journal.jsonl", "a") as f:
        for line in lines:
            f.write(line + "\n")
    return root


@pytest.mark.parametrize("bomb", [BOMB, DEEP_OK_FOR_PARSER, '{"a":' * 5000 + "1" + "}" * 5000])
def test_load_json_refuses_depth_bombs_cleanly(bomb):
    with pytest.raises(flashckpt.FlashCkptError, match=r"nested|objects and lists"):
        load_json(bomb, where="x.json", max_bytes=1 << 30)


def test_load_json_refuses_nan_and_size():
    with pytest.raises(flashckpt.FlashCkptError, match="not valid JSON"):
        load_json('{"t": NaN}', where="x.json", max_bytes=100)
    with pytest.raises(flashckpt.FlashCkptError, match="larger"):
        load_json("[1]" * 100, where="x.json", max_bytes=10)


@pytest.mark.parametrize("bomb", [BOMB, DEEP_OK_FOR_PARSER])
def test_journal_bomb_line_is_skipped_by_status_report_and_auto(tmp_path, bomb):
    root = _root_with_journal(tmp_path, bomb, '{"event": ["list"]}', '{"event": {"a": 1}}')
    events = read_events(root)
    assert events and all(isinstance(e["event"], str) for e in events)
    rc, out = _run("status", str(root))
    assert rc == 0, out
    rc, out = _run("report", str(root), "-o", str(tmp_path / "r.html"))
    assert rc == 0, out
    with flashckpt.Checkpointer(root, save_policy=Auto(mtbf_s=3600)) as ckpt:
        assert ckpt.restore(small_state()) == 1


def test_journal_event_list_does_not_crash_report(tmp_path):
    root = _root_with_journal(tmp_path, '{"event": ["list"], "t": 1}')
    rc, out = _run("report", str(root), "-o", str(tmp_path / "r.html"))
    assert rc == 0, out


def test_journal_huge_line_is_skipped(tmp_path):
    root = _root_with_journal(tmp_path, json.dumps({"event": "x", "pad": "a" * (3 << 20)}))
    Journal(root / "journal.jsonl").append("after")
    names = [e["event"] for e in read_events(root)]
    assert "x" not in names and names[-1] == "after"


@pytest.mark.parametrize("bomb", [BOMB, DEEP_OK_FOR_PARSER, '{"tiers": [{"name": ["x"]}]}'])
def test_tiers_json_bomb_does_not_crash_ls_or_open(tmp_path, bomb):
    root = tmp_path / "root"
    with flashckpt.Checkpointer(root) as ckpt:
        ckpt.save(1, small_state(1.0))
    (root / "tiers.json").write_text(bomb)
    rc, out = _run("ls", str(root))
    assert rc == 0 and "1" in out, out
    with flashckpt.Checkpointer(root) as ckpt:  # rewrites tiers.json
        assert ckpt.restore(small_state()) == 1
    assert json.loads((root / "tiers.json").read_text())["tiers"]


@pytest.mark.parametrize("bomb", [BOMB[:90], "[" * 90, '{"step": [[[[[[1]]]]]]}'])
def test_run_marker_bomb_is_ignored(tmp_path, bomb):
    root = tmp_path / "root"
    with flashckpt.Checkpointer(root) as ckpt:
        ckpt.save(1, small_state(1.0))
    (root / "locks" / "running.json").write_text(bomb)
    with flashckpt.Checkpointer(root) as ckpt:
        assert ckpt.restore(small_state()) == 1
    assert any(e["event"] == "crash_detected" for e in read_events(root))
