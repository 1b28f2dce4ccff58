"""state/tree.py: ``tensor_refs`` (the saved tree's tensors, read once per restore) finds every
reference in order without a call per tensor, and refuses exactly the trees the recursive walk
it replaced refused; ``tensor_leaves`` gives the leaves ``encode_tree`` finds."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flashckpt.errors import ManifestError
from flashckpt.state.tree import _MAX_DEPTH, encode_tree, tensor_leaves, tensor_refs


def _reference(node: Any, depth: int = 0) -> list[tuple[str, str]]:
    """The recursive walk tensor_refs had (one call per value)."""
    if depth > _MAX_DEPTH:
        raise ManifestError("deep")
    out: list[tuple[str, str]] = []
    if isinstance(node, list):
        for v in node:
            out += _reference(v, depth + 1)
    elif isinstance(node, dict):
        if len(node) == 1 and ("__t__" in node or "__np__" in node):
            ((tag, val),) = node.items()
            return [("torch" if tag == "__t__" else "numpy", str(val))]
        for v in node.values():
            out += _reference(v, depth + 1)
    return out


def _outcome(fn: Any, tree: Any) -> Any:
    try:
        return fn(tree)
    except ManifestError:
        return "refused"


_leaf = st.one_of(
    st.integers(),
    st.text(max_size=3),
    st.none(),
    st.builds(lambda k: {"__t__": k}, st.text(max_size=4) | st.integers()),
    st.builds(lambda k: {"__np__": k}, st.text(max_size=4)),
    st.builds(lambda k: {"__t__": k, "x": 1}, st.text(max_size=2)),  # not a reference
)
_trees = st.recursive(
    _leaf,
    lambda kids: (
        st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=3), kids, max_size=4)
    ),
    max_leaves=40,
)


@settings(max_examples=300, deadline=None)
@given(_trees, st.integers(min_value=_MAX_DEPTH - 6, max_value=_MAX_DEPTH + 1) | st.just(0))
def test_refs_match_the_recursive_walk(tree: Any, start: int) -> None:
    assert _outcome(lambda t: tensor_refs(t, start), tree) == _outcome(
        lambda t: _reference(t, start), tree
    )


@pytest.mark.parametrize("extra", [0, 1])
def test_a_reference_one_level_too_deep_is_refused(extra: int) -> None:
    node: Any = {"__t__": "k"}
    for _ in range(_MAX_DEPTH + extra):
        node = [node]
    if extra:
        with pytest.raises(ManifestError, match="deeper"):
            tensor_refs(node)
    else:
        assert tensor_refs(node) == [("torch", "k")]


def test_tensor_leaves_are_the_leaves_encode_tree_finds() -> None:
    t = torch.ones(2)
    state = {"a": t, "b": [t, {"c": torch.zeros(1)}], "d": 3, "e": (torch.ones(3),)}
    _, leaves = encode_tree(state, "s")
    got = tensor_leaves(state, "s")
    assert list(got) == [leaf.key for leaf in leaves]
    assert all(got[leaf.key] is leaf.value for leaf in leaves)
