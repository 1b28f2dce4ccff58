"""A JSON file with a duplicate key is damage, for every reader (store/files/jsonfile.py).

``json.loads`` keeps the last of two equal keys and says nothing: a manifest with two "step"
keys, or two entries for one tensor, read one way by restore and could be shown another way by
a person or another tool. There is one parser for every file flashckpt reads, and it refuses
such a document: ``verify`` reports it damaged, ``restore`` skips it, and an explicit
``restore(step=N)`` raises CorruptCheckpointError.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

import flashckpt
from flashckpt.cli import main
from flashckpt.errors import ConfigError, CorruptCheckpointError, FlashCkptError
from flashckpt.store.files.jsonfile import load_json


def _state(v: float) -> dict[str, torch.Tensor]:
    return {"w": torch.full((4,), v), "b": torch.full((2,), -v)}


@pytest.fixture
def root(tmp_path: Path) -> Path:
    with flashckpt.Checkpointer(tmp_path / "ck") as ck:
        ck.save(1, _state(1.0))
        ck.save(2, _state(2.0))
    return tmp_path / "ck"


def _duplicate(path: Path, where: str) -> None:
    text = path.read_text()
    if where == "top":  # a first "step" that the last one silently overrode
        out = text.replace('{"format"', '{"step":7,"format"', 1)
    else:  # a second entry for tensor "w", before the real one
        head, tail = text.split('"tensors":{', 1)
        entry = tail.split('"b":', 1)[0]  # '"w":{...},'
        out = head + '"tensors":{' + entry + tail
    assert out != text
    path.write_text(out)


@pytest.mark.parametrize("where", ["top", "tensor"])
def test_duplicate_key_is_damage_for_verify_and_restore(root: Path, where, capsys) -> None:
    _duplicate(root / "steps" / "000000000002.json", where)
    assert main(["verify", str(root)]) == 1
    out = capsys.readouterr().out
    assert "DAMAGED" in out and "duplicate key" in out, out
    got = _state(0.0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert flashckpt.restore(root, got) == 1  # skipped, the older one loads
    assert any("skipping damaged checkpoint step 2" in str(w.message) for w in caught)
    assert torch.equal(got["w"], _state(1.0)["w"])
    with pytest.raises(CorruptCheckpointError, match="duplicate key"):
        flashckpt.restore(root, _state(0.0), step=2)


def test_the_one_parser_refuses_duplicates_at_any_depth() -> None:
    with pytest.raises(ConfigError, match="duplicate key 'a'"):
        load_json('{"x": [{"a": 1, "a": 1}]}', where="f", max_bytes=100, error=ConfigError)
    with pytest.raises(FlashCkptError, match="duplicate key 'step'"):
        load_json('{"step": 1, "step": 2}', where="f", max_bytes=100)
    assert load_json('{"a": {"a": 1}}', where="f", max_bytes=100) == {"a": {"a": 1}}


def test_tiers_json_and_the_replication_record_go_through_it(tmp_path: Path) -> None:
    from flashckpt.distributed.replication.record import read_record
    from flashckpt.engine.tiers.identity import read_trusted_config

    (tmp_path / "tiers.json").write_text('{"tiers": [], "tiers": [{"name": "x", "url": "y"}]}')
    with pytest.raises(ConfigError, match="duplicate key 'tiers'"):
        read_trusted_config(tmp_path)
    (tmp_path / "replication.json").write_text('{"replicated": {"3": {}}, "replicated": {"4": {}}}')
    assert read_record(tmp_path) == {}  # unreadable: ignored (with a warning), never half-read
