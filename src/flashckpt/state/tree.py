"""Encode a state tree as JSON plus a list of tensors, and decode it back.

The JSON tree keeps every non-tensor value; tensors and NumPy arrays are replaced by references
to :class:`TensorItem` keys. Values JSON cannot hold natively are tagged:

=====================  =======================================================
``{"__t__": key}``      a torch tensor, stored as tensor bytes under ``key``
``{"__np__": key}``     a NumPy array, stored as tensor bytes under ``key``
``{"__tuple__": [..]}`` a tuple
``{"__dict__": [[k, v], ..]}``  a dict whose keys are not all plain strings
``{"__float__": "nan"}``  nan / inf / -inf
``{"__npscalar__": dtype, "v": value}``  a NumPy scalar
``{"__bytes__": hex}``  a small bytes object
=====================  =======================================================

Anything else (a lambda, a file handle, an arbitrary object) is refused with
:class:`~flashckpt.errors.UnsupportedStateError` naming its key, before anything is written.
Decoding never constructs anything but these plain types.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from flashckpt.errors import ManifestError, UnsupportedStateError

_TAGS = frozenset(
    ("__t__", "__np__", "__tuple__", "__dict__", "__float__", "__npscalar__", "__bytes__")
)
_MAX_BYTES_LEAF = 1 << 20
_MAX_DEPTH = 200


@dataclass(frozen=True, kw_only=True)
class Leaf:
    """A tensor-like leaf found while encoding: its key, value and where it sits."""

    key: str
    value: torch.Tensor | np.ndarray


class Encoder:
    """Walks a tree, collecting tensor leaves and producing the JSON tree."""

    def __init__(self) -> None:
        self.leaves: list[Leaf] = []
        self._keys: set[str] = set()

    def encode(self, obj: Any, path: str, depth: int = 0) -> Any:
        if depth > _MAX_DEPTH:
            raise UnsupportedStateError(f"state at {path!r} is nested deeper than {_MAX_DEPTH}")
        if isinstance(obj, torch.Tensor):  # first: most leaves of a training state are tensors
            return {"__t__": self._leaf(path, obj)}
        if obj is None or isinstance(obj, (bool, str)):
            return obj
        if isinstance(obj, int) and type(obj) is int:
            return obj
        if isinstance(obj, float) and type(obj) is float:
            return obj if math.isfinite(obj) else {"__float__": repr(obj)}
        if isinstance(obj, np.ndarray):
            return {"__np__": self._leaf(path, obj)}
        if isinstance(obj, np.generic):  # the value encoded like any other (nan, bytes, ...)
            return {"__npscalar__": obj.dtype.str, "v": self.encode(obj.item(), path, depth + 1)}
        if isinstance(obj, (bytes, bytearray)):
            return self._bytes(obj, path)
        if isinstance(obj, (list, tuple)):
            items = [self.encode(v, f"{path}/{i}", depth + 1) for i, v in enumerate(obj)]
            return items if isinstance(obj, list) else {"__tuple__": items}
        if isinstance(obj, dict):
            return self._dict(obj, path, depth)
        raise UnsupportedStateError(
            f"cannot save {type(obj).__module__}.{type(obj).__qualname__} at key {path!r}: "
            "state may hold tensors, NumPy arrays, JSON values (int, float, str, bool, None), "
            "lists, tuples, dicts, and objects with state_dict()/load_state_dict(); "
            "convert it or drop it from the state"
        )

    def _dict(self, obj: dict[Any, Any], path: str, depth: int) -> Any:
        plain = all(isinstance(k, str) and k not in _TAGS for k in obj)
        if plain and depth < _MAX_DEPTH:  # a tensor value without a call of encode (most
            tensor, leaf, encode = torch.Tensor, self._leaf, self.encode  # of a state_dict)
            return {
                k: {"__t__": leaf(f"{path}/{k}", v)}
                if isinstance(v, tensor)
                else encode(v, f"{path}/{k}", depth + 1)
                for k, v in obj.items()
            }
        if plain:  # at the depth limit: encode refuses whatever the dict holds
            return {k: self.encode(v, f"{path}/{k}", depth + 1) for k, v in obj.items()}
        pairs = []
        for k, v in obj.items():
            if not (k is None or isinstance(k, (str, int, float, bool, tuple))):
                raise UnsupportedStateError(
                    f"dict key {k!r} at {path!r} has type {type(k).__name__}; "
                    "keys must be str, int, float, bool, None or tuples of those"
                )
            pairs.append(
                [
                    self.encode(k, f"{path}/<key>", depth + 1),
                    self.encode(v, f"{path}/{k}", depth + 1),
                ]
            )
        return {"__dict__": pairs}

    def _bytes(self, obj: bytes | bytearray, path: str) -> Any:
        if len(obj) > _MAX_BYTES_LEAF:
            raise UnsupportedStateError(
                f"bytes value at {path!r} is {len(obj)} bytes; store large binary data as a "
                "uint8 tensor or NumPy array instead"
            )
        return {"__bytes__": bytes(obj).hex()}

    def _leaf(self, path: str, value: torch.Tensor | np.ndarray) -> str:
        key = path
        n = 1
        while key in self._keys:
            key = f"{path}#{n}"
            n += 1
        self._keys.add(key)
        self.add_leaf(key, value)
        return key

    def add_leaf(self, key: str, value: torch.Tensor | np.ndarray) -> None:
        """Record a tensor leaf under its unique ``key`` (a subclass may take it instead)."""
        self.leaves.append(Leaf(key=key, value=value))


def encode_tree(obj: Any, path: str) -> tuple[Any, list[Leaf]]:
    """Encode ``obj`` found at ``path``; return the JSON tree and its tensor leaves."""
    enc = Encoder()
    return enc.encode(obj, path), enc.leaves


class _LeafValues(Encoder):
    def __init__(self) -> None:
        super().__init__()
        self.values: dict[str, torch.Tensor | np.ndarray] = {}

    def add_leaf(self, key: str, value: torch.Tensor | np.ndarray) -> None:
        self.values[key] = value


def tensor_leaves(obj: Any, path: str) -> dict[str, torch.Tensor | np.ndarray]:
    """``{key: tensor}`` of the leaves :func:`encode_tree` would find (a restore's targets),
    without a :class:`Leaf` per tensor."""
    enc = _LeafValues()
    enc.encode(obj, path)
    return enc.values


TensorLookup = Callable[[str, str], Any]
"""``lookup(kind, key)`` returns the tensor ("torch") or array ("numpy") stored under ``key``."""


def decode_tree(node: Any, lookup: TensorLookup, depth: int = 0) -> Any:
    """Rebuild plain Python values from a JSON tree; tensors come from ``lookup``."""
    if depth > _MAX_DEPTH:
        raise ManifestError(f"state tree nested deeper than {_MAX_DEPTH}")
    if isinstance(node, list):
        return [decode_tree(v, lookup, depth + 1) for v in node]
    if not isinstance(node, dict):
        return node
    if len(node) == 1:
        ((tag, val),) = node.items()
        if tag == "__t__" and isinstance(val, str):
            return lookup("torch", val)
        if tag == "__np__" and isinstance(val, str):
            return lookup("numpy", val)
        if tag == "__tuple__" and isinstance(val, list):
            return tuple(decode_tree(v, lookup, depth + 1) for v in val)
        if tag == "__dict__" and isinstance(val, list):
            return _decode_pairs(val, lookup, depth)
        if tag == "__float__" and val in ("nan", "inf", "-inf"):
            return float(val)
        if tag == "__bytes__" and isinstance(val, str):
            return _decode_hex(val)
    if set(node) == {"__npscalar__", "v"}:
        return _decode_npscalar(node, depth)
    return {k: decode_tree(v, lookup, depth + 1) for k, v in node.items()}


def _decode_pairs(pairs: list[Any], lookup: TensorLookup, depth: int) -> dict[Any, Any]:
    out: dict[Any, Any] = {}
    for pair in pairs:
        if not (isinstance(pair, list) and len(pair) == 2):
            raise ManifestError("malformed __dict__ entry in state tree")
        key = decode_tree(pair[0], lookup, depth + 1)
        try:
            hash(key)
        except TypeError as exc:
            raise ManifestError(f"unhashable dict key in state tree: {key!r}") from exc
        out[key] = decode_tree(pair[1], lookup, depth + 1)
    return out


def _decode_hex(val: str) -> bytes:
    try:
        return bytes.fromhex(val)
    except ValueError as exc:
        raise ManifestError("malformed __bytes__ value in state tree") from exc


def _decode_npscalar(node: dict[str, Any], depth: int) -> Any:
    from flashckpt.store.format.dtypes import numpy_dtype

    dtype = numpy_dtype(node["__npscalar__"])
    value = decode_tree(node["v"], _no_tensors, depth + 1)
    try:
        return dtype.type(value)
    except (TypeError, ValueError, OverflowError) as exc:
        raise ManifestError(f"malformed NumPy scalar in state tree: {node!r}") from exc


def _no_tensors(kind: str, key: str) -> Any:
    raise ManifestError(f"a NumPy scalar in the state tree refers to tensor {key!r}")


def tensor_refs(node: Any, depth: int = 0) -> list[tuple[str, str]]:
    """All ``(kind, key)`` tensor references in a JSON tree, in order. Every list or object is
    one level, a reference ``{"__t__": key}`` is not descended into, and no value may sit deeper
    than ``_MAX_DEPTH`` (store/format/parse.py refuses the same trees)."""
    out: list[tuple[str, str]] = []
    _refs(node, depth, out)
    return out


def _refs(node: Any, depth: int, out: list[tuple[str, str]]) -> None:
    if depth > _MAX_DEPTH:
        raise ManifestError(f"state tree nested deeper than {_MAX_DEPTH}")
    if isinstance(node, list):
        children: Any = node
    elif isinstance(node, dict):
        if len(node) == 1 and ("__t__" in node or "__np__" in node):
            ((tag, val),) = node.items()
            out.append(("torch" if tag == "__t__" else "numpy", str(val)))
            return
        children = node.values()
    else:
        return
    below = depth + 1
    for v in children:  # a reference is read here, without a call per tensor
        if below <= _MAX_DEPTH and type(v) is dict and len(v) == 1:
            if "__t__" in v:
                out.append(("torch", str(v["__t__"])))
                continue
            if "__np__" in v:
                out.append(("numpy", str(v["__np__"])))
                continue
        if below > _MAX_DEPTH or isinstance(v, (list, dict)):
            _refs(v, below, out)
