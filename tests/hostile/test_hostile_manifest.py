"""Exact manifest validation: shards tile each tensor (no gap, no overlap), sizes fit a stated
limit, the state tree is no deeper than restore decodes; verify and restore agree."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

import flashckpt
from flashckpt.store.files.backend import LocalBackend
from flashckpt.store.format.manifest import TensorEntry, check_allocatable
from flashckpt.store.format.parse import parse_manifest
from flashckpt.store.format.tiling import check_tiling
from flashckpt.store.store import CheckpointStore
from flashckpt.store.verify import verify_step
from hostile.util import manifest_path, restore_newest, sharded_form, small_state

pytestmark = pytest.mark.timeout(60)


def _edit(root: Path, step: int, fn) -> None:
    p = manifest_path(root, step)
    doc = json.loads(p.read_text())
    fn(doc)
    p.write_text(json.dumps(doc))


def _verify_ok(root: Path, step: int) -> bool:
    return verify_step(CheckpointStore(LocalBackend(root, create=False)), step).ok


def _key(doc) -> dict:
    return next(v for k, v in doc["tensors"].items() if k.startswith("w"))


@pytest.mark.parametrize("layout, message", [("sharded", r"\(a gap"), ("compact", "do not add up")])
def test_shards_with_a_gap_are_refused_by_restore_and_verify(two_steps, layout, message):
    """A tensor whose bytes cover 64 of its claimed 65,536 elements: as shards, a gap in the
    tiling; as a compact entry (the whole tensor), extents that do not add up."""
    root = two_steps()

    def grow(doc) -> None:
        if layout == "sharded":
            sharded_form(doc)
        _key(doc)["global_shape"] = [65536]

    _edit(root, 2, grow)
    assert not _verify_ok(root, 2)
    with pytest.warns(UserWarning, match="step 2"):
        assert restore_newest(root) == 1
    with (
        flashckpt.Checkpointer(root) as ckpt,
        pytest.raises(flashckpt.ManifestError, match=message),
    ):
        ckpt.restore(small_state(), step=2)


def test_overlapping_shards_are_refused(two_steps):
    root = two_steps()

    def split(doc) -> None:
        e = _key(sharded_form(doc))
        (shard,) = e["shards"]
        (chunk, off, _length) = shard["extents"][0]
        a = {"offset": [0], "shape": [40], "rank": 0, "extents": [[chunk, off, 160]]}
        b = {"offset": [24], "shape": [40], "rank": 1, "extents": [[chunk, off, 160]]}
        e["shards"] = [a, b]  # volumes add up to 80 != 64 here; overlap is found first

    _edit(root, 2, split)
    with flashckpt.Checkpointer(root) as ckpt:
        with pytest.raises(flashckpt.ManifestError, match="overlap"):
            ckpt.restore(small_state(), step=2)
    assert not _verify_ok(root, 2)


def test_tiling_checks_boxes_not_only_volumes():
    # two 2x2 boxes of a 2x4 tensor: same total volume (8), but overlapping, leaving a gap
    assert "overlap" in (check_tiling((2, 4), [((0, 0), (2, 2)), ((0, 1), (2, 2))], whole=True))
    assert check_tiling((2, 4), [((0, 0), (2, 2)), ((0, 2), (2, 2))], whole=True) is None
    assert check_tiling((4, 4), [((0, 0), (2, 4)), ((2, 0), (2, 4))], whole=True) is None
    assert "gap" in check_tiling((4, 4), [((0, 0), (2, 4))], whole=True)
    assert check_tiling((4, 4), [((0, 0), (2, 4))], whole=False) is None  # a rank's part
    assert "overlap" in check_tiling((), [((), ()), ((), ())], whole=True)
    rows = [((i, 0), (1, 8)) for i in range(4096)]
    assert check_tiling((4096, 8), rows, whole=True) is None  # FSDP-style: fast sweep


def test_absurd_tensor_size_is_a_manifest_error_not_an_allocator_crash(two_steps):
    root = two_steps()
    _edit(root, 2, lambda d: _key(d).__setitem__("global_shape", [2**45]))
    with flashckpt.Checkpointer(root) as ckpt:
        with pytest.raises(flashckpt.CorruptCheckpointError):
            ckpt.restore(small_state(), step=2)
    with pytest.warns(UserWarning, match="step 2"):
        assert restore_newest(root) == 1


def test_check_allocatable_refuses_more_than_this_machine_holds():
    huge = TensorEntry(key="k", kind="torch", dtype="float32", global_shape=(2**45,), shards=())
    with pytest.raises(flashckpt.ManifestError, match="this machine"):
        check_allocatable(huge)
    check_allocatable(
        TensorEntry(key="k", kind="torch", dtype="float32", global_shape=(8,), shards=())
    )


def test_too_deep_tree_fails_verify_exactly_like_restore(two_steps):
    root = two_steps()
    deep: object = 1
    for _ in range(900):
        deep = [deep]
    _edit(root, 2, lambda d: d["tree"].__setitem__("meta", deep))
    assert not _verify_ok(root, 2)
    with flashckpt.Checkpointer(root) as ckpt:
        with pytest.raises(flashckpt.ManifestError, match="deeper"):
            ckpt.restore(small_state(), step=2)


def test_deep_tree_that_restore_accepts_passes_verify(tmp_path):
    """No false positive: a tree nested almost as deep as restore allows."""
    node: object = torch.ones(2)
    for _ in range(198):
        node = [node]
    with flashckpt.Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, {"deep": {"x": node}})
    assert _verify_ok(tmp_path, 1)
    target = {"deep": {"x": None}}
    with flashckpt.Checkpointer(tmp_path) as ckpt:
        assert ckpt.restore(target) == 1


def test_parse_refuses_nonfinite_and_absurd_time():
    doc = {"format": "flashckpt", "version": 1, "step": 1, "chunks": [], "tensors": {}}
    for bad in ("NaN", "1e999", "-5"):
        data = json.dumps(doc)[:-1] + f', "time": {bad}}}'
        with pytest.raises(flashckpt.ManifestError):
            parse_manifest(data.encode())


def test_entry_metadata_must_be_shallow_objects():
    """The manifest's ``meta`` (an HF model's config, issue 31) is parsed as strictly as the
    rest: an object of objects, no deeper than MAX_META_DEPTH; kept as given when it is."""
    doc = {"format": "flashckpt", "version": 1, "step": 1, "chunks": [], "tensors": {}}
    deep: dict[str, object] = {}
    node = deep
    for _ in range(40):
        node["x"] = {}
        node = node["x"]  # type: ignore[assignment]
    for bad in ([1], {"model": 3}, {"model": deep}):
        with pytest.raises(flashckpt.ManifestError, match="'meta'"):
            parse_manifest(json.dumps({**doc, "meta": bad}).encode())
    good = {"model": {"hf_config": {"model_type": "gpt2", "n_embd": 32}}}
    assert parse_manifest(json.dumps({**doc, "meta": good}).encode()).meta == good
    assert parse_manifest(json.dumps(doc).encode()).meta == {}


@pytest.mark.parametrize("dtype", [">f4", ">i8", ">f8", ">u2"])
def test_big_endian_arrays_round_trip_with_their_values(tmp_path, dtype):
    arr = (np.arange(7) * 1000 + 3).astype(dtype)
    with flashckpt.Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, {"s": {"a": arr}})
    target = {"s": {"a": np.zeros(7, dtype=dtype)}}
    with flashckpt.Checkpointer(tmp_path) as ckpt:
        ckpt.restore(target)
    np.testing.assert_array_equal(target["s"]["a"], arr)
