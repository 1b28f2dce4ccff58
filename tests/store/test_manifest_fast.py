"""The manifest parser builds its per-tensor objects without the frozen dataclass ``__init__``
(store/format/parse.py ``_maker``): the objects must still be exactly the dataclasses, every
field present, equal and hashable like constructed ones, and still frozen."""

from __future__ import annotations

import dataclasses
import json

import pytest

from flashckpt.store.format import manifest as mf
from flashckpt.store.format import parse as mp


def _doc() -> bytes:
    chunks = [["0" * 31 + "1", 4096, "raw", 4096]]
    tensors = {
        "a": {
            "kind": "torch",
            "dtype": "float32",
            "global_shape": [4, 8],
            "shards": [
                {"offset": [0, 0], "shape": [2, 8], "extents": [[0, 0, 64]]},
                {"offset": [2, 0], "shape": [2, 8], "extents": [[0, 64, 64]], "rank": 1},
            ],
        },
        "b": {
            "kind": "numpy",
            "dtype": "<i8",
            "global_shape": [3],
            "shards": [{"offset": [0], "shape": [3], "extents": [[0, 128, 24]]}],
        },
    }
    doc = {"format": "flashckpt", "version": 1, "step": 7, "time": 1.0, "chunks": chunks}
    return json.dumps({**doc, "tree": {}, "tensors": tensors}).encode()


def _rebuilt(obj: object) -> object:
    """The same object made by the dataclass's own constructor, recursively."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        kw = {f.name: _rebuilt(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
        return type(obj)(**kw)
    if isinstance(obj, tuple):
        return tuple(_rebuilt(x) for x in obj)
    return obj


def test_parsed_objects_equal_constructed_ones() -> None:
    m = mp.parse_manifest(_doc())
    assert set(m.tensors) == {"a", "b"}
    for entry in m.tensors.values():
        assert type(entry) is mf.TensorEntry
        for obj in (entry, *entry.shards, *(x for s in entry.shards for x in s.extents)):
            names = {f.name for f in dataclasses.fields(obj)}  # type: ignore[arg-type]
            assert set(vars(obj)) == names, type(obj)  # every field, nothing else
        again = _rebuilt(entry)
        assert again == entry and hash(again) == hash(entry)
    assert m.tensors["a"].shards[1].rank == 1 and m.tensors["b"].shards[0].rank == 0
    assert m.tensors["a"].shards[1].extents[0] == mf.Extent(chunk=0, offset=64, length=64)


def test_parsed_objects_stay_frozen() -> None:
    entry = mp.parse_manifest(_doc()).tensors["a"]
    with pytest.raises(dataclasses.FrozenInstanceError):
        entry.dtype = "float64"  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        entry.shards[0].extents[0].length = 1  # type: ignore[misc]


def test_a_class_that_validates_gets_no_fast_constructor() -> None:
    @dataclasses.dataclass(frozen=True, kw_only=True)
    class Checked:
        n: int

        def __post_init__(self) -> None:
            if self.n < 0:
                raise ValueError("negative")

    with pytest.raises(TypeError, match="__post_init__"):
        mp._maker(Checked)
