"""``flashckpt report`` and ``flashckpt status`` (parsers registered as the CLI does)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from flashckpt.cli import report as report_cmd
from flashckpt.cli import status as status_cmd
from flashckpt.errors import ConfigError


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="flashckpt")
    sub = parser.add_subparsers(dest="command")
    report_cmd.register(sub)
    status_cmd.register(sub)
    return parser.parse_args(argv)


def test_report_command_writes_html(
    root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "r.html"
    args = parse(["report", str(root), "-o", str(out), "--gpu-hour-price", "2.5"])
    assert args.func(args) == 0
    assert out.read_text(encoding="utf-8").count("<svg") == 6
    assert f"wrote {out} (10 saves" in capsys.readouterr().out


def test_report_default_output_is_report_html(
    root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    args = parse(["report", str(root)])
    assert args.func(args) == 0 and (tmp_path / "report.html").is_file()


def test_status_text(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = parse(["status", str(root), "--gpu-hour-price", "2.5"])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert "saves     10 (1 failed, 0 skipped)" in out
    assert "1 crash(es)" in out and "70 steps lost" in out
    assert "goodput   78.0% · cost 0.46" in out
    assert "restart   last 1.79 min (down 400 ms · start 1.58 min · restore 12 s" in out
    assert "governor  no decision journaled" in out  # these saves were not governed
    assert len(out.splitlines()) == 10


def test_status_json_and_empty_root(
    root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = parse(["status", str(root), "--json"])
    assert args.func(args) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["saves"] == 10 and data["crashes"] == 1
    empty = tmp_path / "empty"
    empty.mkdir()
    args = parse(["status", str(empty)])
    assert args.func(args) == 0 and "no journal events yet" in capsys.readouterr().out


@pytest.mark.parametrize("cmd", ["report", "status"])
def test_missing_root_is_a_config_error(cmd: str, tmp_path: Path) -> None:
    args = parse([cmd, str(tmp_path / "missing")])
    with pytest.raises(ConfigError, match="ROOT"):
        args.func(args)
