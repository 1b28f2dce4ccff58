"""Loading never runs code, never leaves root, never allocates absurd memory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import flashckpt
from flashckpt.store.format.parse import parse_manifest
from hostile.util import sharded_form


def _valid(tmp_path: Path, layout: str = "compact") -> dict:
    """The manifest of a saved step: as written (each entry compact, format version 2), or
    with its entries as shards (``sharded``: version 2's other form; ``v1``: version 1)."""
    with flashckpt.Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, {"w": torch.arange(8, dtype=torch.float32)})
    doc = json.loads((tmp_path / "steps" / "000000000001.json").read_text())
    assert doc["version"] == 2 and "extents" in doc["tensors"]["w"]
    if layout == "compact":
        return doc
    return sharded_form(doc, version=1 if layout == "v1" else None)


def _extent(d: dict) -> list:
    """Tensor ``w``'s first extent, in either layout."""
    w = d["tensors"]["w"]
    return (w["extents"] if "extents" in w else w["shards"][0]["extents"])[0]


def _halve(d: dict) -> None:
    """Tensor ``w``'s only shard now claims half the bytes its extents hold."""
    w = d["tensors"]["w"]
    if "extents" in w:
        w["global_shape"] = [4]
    else:
        w["shards"][0]["shape"] = [4]


def _write(tmp_path: Path, doc: dict | str) -> None:
    text = doc if isinstance(doc, str) else json.dumps(doc)
    (tmp_path / "steps" / "000000000001.json").write_text(text)


def _restore_step(tmp_path: Path):
    with flashckpt.Checkpointer(tmp_path) as ckpt:
        return ckpt.restore({"w": torch.zeros(8)}, step=1)


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda d: d["chunks"][0].__setitem__(0, "../../../../etc/passwd"), "hash"),
        (lambda d: d["chunks"][0].__setitem__(0, "ab/../../x" + "0" * 22), "hash"),
        (lambda d: d["tensors"]["w"].__setitem__("dtype", "object"), "allow-list"),
        (lambda d: d["tensors"]["w"].__setitem__("global_shape", [2**40, 2**40]), "absurd"),
        (lambda d: _extent(d).__setitem__(2, 2**33), "extent"),
        (lambda d: _extent(d).__setitem__(0, 5), "extent chunk"),
        (lambda d: _extent(d).__setitem__(1, -1), "extent offset"),
        (lambda d: _extent(d).__setitem__(1, True), "extent offset"),
        (lambda d: d["chunks"][0].__setitem__(2, "pickle"), "codec"),
        (lambda d: d.__setitem__("version", "99"), "version"),
        (lambda d: d.__setitem__("version", 0), "version"),
        (lambda d: d.__setitem__("version", True), "version"),
        (_halve, "add up|gap"),
    ],
)
@pytest.mark.parametrize("layout", ["compact", "sharded", "v1"])
def test_hostile_manifest_rejected(tmp_path, mutate, message, layout):
    doc = _valid(tmp_path, layout)
    mutate(doc)
    _write(tmp_path, doc)
    with pytest.raises(flashckpt.CorruptCheckpointError, match=message):
        _restore_step(tmp_path)


def test_not_json_and_wrong_type(tmp_path):
    _valid(tmp_path)
    for text in ("\x00\x01garbage", "[1, 2, 3]", '{"format": "flashckpt"}', "{" * 100000):
        _write(tmp_path, text)
        with pytest.raises(flashckpt.ManifestError):
            _restore_step(tmp_path)


def test_keys_never_become_paths(tmp_path):
    evil = {"../../escape": torch.ones(3), "/abs/path": torch.ones(2), "a/../../b": 1}
    with flashckpt.Checkpointer(tmp_path / "root") as ckpt:
        ckpt.save(1, {"x": evil})
    written = {p.relative_to(tmp_path) for p in tmp_path.rglob("*") if p.is_file()}
    assert all(str(p).startswith("root/") for p in written), written
    out = {"x": None}
    with flashckpt.Checkpointer(tmp_path / "root") as ckpt:
        ckpt.restore(out)
    assert torch.equal(out["x"]["../../escape"], torch.ones(3))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=300) | st.text(max_size=300).map(str.encode))
def test_fuzzed_manifest_bytes_only_raise_flashckpt_errors(data):
    try:
        parse_manifest(data)
    except flashckpt.FlashCkptError:
        pass


_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=20,
)


@settings(max_examples=150, deadline=None)
@given(_json)
def test_fuzzed_manifest_structures(doc):
    body = {"format": "flashckpt", "version": 1, "step": 1, "chunks": doc, "tensors": doc}
    try:
        parse_manifest(json.dumps(body).encode())
    except flashckpt.FlashCkptError:
        pass
