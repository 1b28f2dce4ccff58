"""Manifest format version 2: a tensor whose one shard is the whole tensor (rank 0) is written
compact, ``{"kind", "dtype", "global_shape", "extents"}``; every other entry keeps version 1's
shards. Version 1 manifests still restore, fast path included; the compact form is parsed as
strictly as the other (the hostile layouts of both are in tests/core/test_hostile.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import flashckpt
from flashckpt.store.files.backend import LocalBackend
from flashckpt.store.format.manifest import READABLE, VERSION
from flashckpt.store.format.parse import parse_manifest
from flashckpt.store.lineage import copy_lineage
from flashckpt.store.store import CheckpointStore
from flashckpt.store.verify import verify_step
from hostile.util import sharded_form


def _state() -> dict[str, object]:
    g = torch.Generator().manual_seed(3)
    return {
        "m": {f"p{i}": torch.randn(4, 3, generator=g) for i in range(50)},
        "scalar": torch.tensor(2.5),
        "meta": {"lr": 0.1},
    }


def _saved(root: Path) -> tuple[dict[str, object], Path]:
    state = _state()
    with flashckpt.Checkpointer(root, incremental=False) as ckpt:
        ckpt.save(1, state)
    return state, root / "steps" / "000000000001.json"


def _restored(root: Path) -> dict[str, object]:
    out = {
        "m": {f"p{i}": torch.zeros(4, 3) for i in range(50)},
        "scalar": torch.tensor(0.0),
        "meta": {},
    }
    with flashckpt.Checkpointer(root) as ckpt:
        assert ckpt.restore(out) == 1
    return out


def _equal(a: dict[str, object], b: dict[str, object]) -> bool:
    m_a, m_b = a["m"], b["m"]
    assert isinstance(m_a, dict) and isinstance(m_b, dict)
    return (
        all(torch.equal(m_a[k], m_b[k]) for k in m_a)
        and torch.equal(a["scalar"], b["scalar"])  # type: ignore[arg-type]
        and a["meta"] == b["meta"]
    )


def test_whole_tensors_are_written_compact_and_the_manifest_is_smaller(tmp_path: Path) -> None:
    state, path = _saved(tmp_path)
    doc = json.loads(path.read_text())
    assert doc["version"] == VERSION == 2 and list(doc)[:3] == ["format", "version", "lineage"]
    entry = doc["tensors"]["m/p0"]
    assert set(entry) == {"kind", "dtype", "global_shape", "extents"}
    assert doc["tensors"]["scalar"]["global_shape"] == [] and "extents" in doc["tensors"]["scalar"]
    v1 = json.dumps(sharded_form(json.loads(path.read_text()), version=1), separators=(",", ":"))
    assert len(path.read_bytes()) < 0.8 * len(v1)
    assert _equal(_restored(tmp_path), state)
    store = CheckpointStore(LocalBackend(tmp_path, create=False))
    assert verify_step(store, 1).ok


def test_a_version_1_manifest_still_restores_and_verifies(tmp_path: Path) -> None:
    state, path = _saved(tmp_path)
    path.write_text(json.dumps(sharded_form(json.loads(path.read_text()), version=1)))
    assert 1 in READABLE
    got = parse_manifest(path.read_bytes())
    assert all(len(e.shards) == 1 for e in got.tensors.values())
    assert _equal(_restored(tmp_path), state)
    assert verify_step(CheckpointStore(LocalBackend(tmp_path, create=False)), 1).ok


@pytest.mark.parametrize("version", [1, 2])
def test_the_lineage_of_either_version_is_read_from_the_head(
    tmp_path: Path, version: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Judging which copy is the checkpoint reads a manifest's first 4 KiB, not the whole
    file (a second of parsing at 50,000 tensors), for version 1 manifests too."""
    _, path = _saved(tmp_path)
    doc = sharded_form(json.loads(path.read_text()), version=version)
    path.write_text(json.dumps(doc, separators=(",", ":")))
    store = CheckpointStore(LocalBackend(tmp_path, create=False))

    def whole(*_a: object, **_k: object) -> bytes:
        raise AssertionError("the whole manifest was read")

    monkeypatch.setattr(store.backend, "read", whole)
    got = copy_lineage(store, 1)
    assert got is not None and got.generation == doc["lineage"]["generation"]


def _doc(tmp_path: Path) -> dict:
    _, path = _saved(tmp_path)
    return json.loads(path.read_text())


def _refused(doc: dict, match: str) -> None:
    with pytest.raises(flashckpt.ManifestError, match=match):
        parse_manifest(json.dumps(doc).encode())


def test_an_entry_with_both_forms_is_refused(tmp_path: Path) -> None:
    doc = _doc(tmp_path)
    entry = doc["tensors"]["m/p3"]
    entry["shards"] = sharded_form({"tensors": {"x": dict(entry)}})["tensors"]["x"]["shards"]
    _refused(doc, "both 'shards' and 'extents'")


def test_a_compact_entry_in_a_version_1_manifest_is_refused(tmp_path: Path) -> None:
    """Version 1 never had compact entries: such a manifest is damaged, not read."""
    doc = _doc(tmp_path)
    doc["version"] = 1
    _refused(doc, "malformed manifest.*shards")


@pytest.mark.parametrize(
    "extents, match",
    [
        ({"0": [0, 0, 48]}, "'extents' must be a list"),
        ([[0, 0]], "malformed extent"),
        ([[0, 0, 24], [0, 24, 23]], "do not add up"),
        ([[0, 0, 48], [0, 0, 0], [7, 0, 0]], "extent chunk"),
        ([[0, "0", 48]], "extent offset"),
        ([[0, 0, 48.0]], "extent length"),
        ([[0, 1 << 40, 48]], "extent offset|runs past"),
    ],
)
def test_compact_extents_are_checked_like_a_shards(tmp_path: Path, extents, match) -> None:
    doc = _doc(tmp_path)
    doc["tensors"]["m/p3"]["extents"] = extents  # 4x3 float32: 48 bytes
    _refused(doc, match)


@pytest.mark.parametrize("version", ["2", 2.0, 0, -3, None])
def test_an_unknown_version_is_refused_by_name(tmp_path: Path, version: object) -> None:
    """Not a version any flashckpt writes: damage. (A newer one is not: test_newer_format.)"""
    doc = _doc(tmp_path)
    doc["version"] = version
    _refused(doc, "format version .* is not supported .*reads versions 1, 2.*is damaged")
    doc["version"] = 3
    with pytest.raises(flashckpt.UnsupportedFormatError, match=r"version 3; .*reads versions 1, 2"):
        parse_manifest(json.dumps(doc).encode())
