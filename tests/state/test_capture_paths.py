"""Capture's fast paths (a plain tensor found in a plain dict, turned into its item as the tree
is walked) give what the general path gives: the same tree, keys, dtypes and bytes, and the
same refusals."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import flashckpt
from flashckpt.errors import UnsupportedStateError
from flashckpt.state.capture import capture
from flashckpt.state.tree import _MAX_DEPTH, encode_tree


class Sub(torch.Tensor):
    pass


def _mixed() -> dict:
    g = torch.Generator().manual_seed(0)
    return {
        "w": torch.randn(3, 4, generator=g),
        "p": torch.nn.Parameter(torch.randn(5, generator=g)),
        "b": torch.nn.Buffer(torch.randn(2, generator=g)),
        "sub": torch.randn(4, generator=g).as_subclass(Sub),
        "t": torch.randn(4, 4, generator=g).t(),  # not contiguous
        "e": torch.empty(0, 3),
        "i": torch.arange(6, dtype=torch.int16).reshape(2, 3),
        "np": np.arange(4, dtype=">i4"),  # big-endian: saved little-endian
        "nested": {"x": torch.ones(2), "l": [torch.zeros(1), 3], "n": None},
        "odd": {1: torch.ones(1)},  # a non-string key: the __dict__ encoding
    }


def test_capture_matches_the_general_encoder() -> None:
    state = _mixed()
    got = capture({"m": state})
    tree, leaves = encode_tree(state, "m")
    assert got.tree == {"m": tree}
    assert [i.key for i in got.items] == [leaf.key for leaf in leaves]
    for item, leaf in zip(got.items, leaves):
        v = leaf.value
        if isinstance(v, np.ndarray):
            want = torch.from_numpy(np.ascontiguousarray(v).astype(v.dtype.newbyteorder("<")))
        else:
            want = v.detach().as_subclass(torch.Tensor)
        assert item.shape == tuple(want.shape) == item.global_shape, item.key
        assert item.global_offset == (0,) * want.dim()
        assert torch.equal(item.data, want.contiguous().reshape(-1).view(torch.uint8)), item.key
        assert item.kind == ("numpy" if isinstance(v, np.ndarray) else "torch")
        if item.kind == "torch":
            assert item.source is v and item.dtype == str(v.dtype).removeprefix("torch.")


def _nest(value: object, depth: int) -> object:
    for _ in range(depth):
        value = {"a": value}
    return value


def test_a_tensor_at_the_depth_limit_is_saved_and_restored(tmp_path) -> None:
    """A tensor value of a plain dict at depth 200 is a leaf restore decodes; one level deeper
    is refused at save, not written as a checkpoint restore would reject."""
    t = torch.arange(3.0)
    with flashckpt.Checkpointer(tmp_path / "ck") as ck:
        ck.save(1, {"m": _nest(t, _MAX_DEPTH)})
        out = {"m": _nest(torch.zeros(3), _MAX_DEPTH)}
        assert ck.restore(out) == 1
    leaf = out["m"]
    for _ in range(_MAX_DEPTH):
        leaf = leaf["a"]  # type: ignore[index]
    assert torch.equal(leaf, t)  # type: ignore[arg-type]
    with pytest.raises(UnsupportedStateError, match="nested deeper"):
        capture({"m": _nest(t, _MAX_DEPTH + 1)})


@pytest.mark.parametrize(
    "bad",
    [
        torch.empty(2, device="meta"),
        torch.nn.Parameter(torch.empty(2, device="meta")),
        torch.eye(3).to_sparse(),
    ],
    ids=["meta", "meta-parameter", "sparse"],
)
def test_plain_dict_refuses_tensors_without_dense_data(bad: torch.Tensor) -> None:
    with pytest.raises(UnsupportedStateError, match=r"'m/x'.*dense"):
        capture({"m": {"ok": torch.ones(1), "x": bad}})
    with pytest.raises(UnsupportedStateError, match=r"'x'.*dense"):
        capture({"x": bad})
