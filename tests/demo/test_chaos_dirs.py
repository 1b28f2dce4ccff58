"""`flashckpt chaos --dir DIR` deletes only the directories it created (demo/chaos_dirs.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flashckpt.demo import chaos
from flashckpt.demo.chaos_dirs import MARKER
from flashckpt.demo.chaos_rounds import run_rounds
from flashckpt.errors import ConfigError


def _fake(cfg, kills, duration):  # no trainer: the cheapest run that still makes its dirs
    Path(cfg["root"]).mkdir()
    return lambda base: {"goodput": 0.5, "failures": len(kills)}


def _run(out: Path, monkeypatch, methods=("flashckpt",)) -> dict:
    monkeypatch.setattr(chaos, "_run_method", _fake)
    return chaos.run_chaos(
        out=out, minutes=1, mtbf_s=10, methods=list(methods), kills=[5.0], baseline_steps=0,
        say=lambda _m: None,
    )  # fmt: skip


def test_a_users_own_subdirectory_is_refused_and_survives(tmp_path: Path, monkeypatch) -> None:
    """Regression: chaos rmtree'd DIR/<method> whatever it was (the user's files included)."""
    mine = tmp_path / "flashckpt"
    mine.mkdir()
    (mine / "notes.txt").write_text("my data")
    with pytest.raises(ConfigError, match=r"not created by flashckpt chaos.*never deleted"):
        _run(tmp_path, monkeypatch)
    assert (mine / "notes.txt").read_text() == "my data"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["flashckpt"]  # nothing written


def test_other_user_content_in_dir_is_kept_and_a_second_run_reuses_its_own(
    tmp_path: Path, monkeypatch
) -> None:
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "keep.bin").write_bytes(b"\x01\x02")
    _run(tmp_path, monkeypatch, methods=("flashckpt", "torch_save"))
    assert (tmp_path / "flashckpt" / MARKER).is_file() and (
        tmp_path / "flashckpt" / "root"
    ).is_dir()
    _run(tmp_path, monkeypatch)  # its own dirs: emptied and reused
    assert (tmp_path / "data" / "keep.bin").read_bytes() == b"\x01\x02"
    assert json.loads((tmp_path / "chaos.json").read_text())["methods"]["flashckpt"]
    assert not (tmp_path / "data" / MARKER).exists()
    assert not (tmp_path / MARKER).exists()  # DIR was the user's: never marked as chaos's own


def test_a_users_chaos_json_is_not_overwritten(tmp_path: Path, monkeypatch) -> None:
    (tmp_path / "chaos.json").write_text("{}")
    with pytest.raises(ConfigError, match=r"chaos\.json"):
        _run(tmp_path, monkeypatch)
    assert (tmp_path / "chaos.json").read_text() == "{}"


def test_rounds_refuse_a_users_round_directory(tmp_path: Path) -> None:
    mine = tmp_path / "round-1"
    mine.mkdir()
    (mine / "x").write_text("mine")
    with pytest.raises(ConfigError, match="round-1"):
        run_rounds(
            out=tmp_path, minutes=1, mtbf_s=10, segments=2, methods=["a"],
            say=lambda _m: None, run=lambda **kw: {"methods": {}},
        )  # fmt: skip
    assert (mine / "x").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["round-1"]
