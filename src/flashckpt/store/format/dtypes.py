"""The dtype allow-list: the only element types a manifest may name.

Tensors are stored as raw little-endian bytes of their element type. A manifest naming any other
dtype is rejected, so loading can never be steered into constructing arbitrary objects.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from flashckpt.errors import ManifestError, UnsupportedStateError

TORCH_DTYPES: dict[str, torch.dtype] = {
    "float64": torch.float64,
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "complex64": torch.complex64,
    "complex128": torch.complex128,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
for _name in ("uint16", "uint32", "uint64", "float8_e4m3fn", "float8_e5m2"):
    if hasattr(torch, _name):
        TORCH_DTYPES[_name] = getattr(torch, _name)

_TORCH_NAMES = {v: k for k, v in TORCH_DTYPES.items()}

NUMPY_DTYPES: dict[str, np.dtype] = {
    f"{np.dtype(n).str}": np.dtype(n)
    for n in (
        "<f8",
        "<f4",
        "<f2",
        "<c8",
        "<c16",
        "<i8",
        "<i4",
        "<i2",
        "|i1",
        "<u8",
        "<u4",
        "<u2",
        "|u1",
        "|b1",
    )
}


def torch_dtype_name(dtype: torch.dtype, key: str = "") -> str:
    try:
        return _TORCH_NAMES[dtype]
    except KeyError:
        raise UnsupportedStateError(
            f"tensor {key!r} has dtype {dtype}, which flashckpt does not store; "
            f"supported: {', '.join(sorted(TORCH_DTYPES))}"
        ) from None


def numpy_dtype_name(dtype: np.dtype, key: str = "") -> str:
    little = dtype.newbyteorder("<") if dtype.byteorder == ">" else dtype
    if little.str not in NUMPY_DTYPES:
        raise UnsupportedStateError(
            f"array {key!r} has dtype {dtype}, which flashckpt does not store; "
            f"supported: {', '.join(sorted(NUMPY_DTYPES))}"
        )
    return little.str


def little_endian_array(arr: np.ndarray) -> np.ndarray:
    """``arr`` as a C-contiguous array in the little-endian byte order flashckpt stores: a
    big-endian array (``>f4``, ``>i8``) is converted (same values), never written as is."""
    dtype = arr.dtype
    if dtype.byteorder == ">" or (dtype.byteorder == "=" and np.little_endian is False):
        return np.ascontiguousarray(arr, dtype=dtype.newbyteorder("<"))
    return np.ascontiguousarray(arr)


def torch_dtype(name: object) -> torch.dtype:
    if not isinstance(name, str) or name not in TORCH_DTYPES:
        raise ManifestError(f"manifest names dtype {name!r}, which is not on the allow-list")
    return TORCH_DTYPES[name]


def numpy_dtype(name: object) -> np.dtype:
    if not isinstance(name, str) or name not in NUMPY_DTYPES:
        raise ManifestError(f"manifest names numpy dtype {name!r}, which is not on the allow-list")
    return NUMPY_DTYPES[name]


@functools.lru_cache(maxsize=128)  # parsing a manifest asks once per tensor; errors are not cached
def itemsize(kind: str, name: str) -> int:
    if kind == "numpy":
        return numpy_dtype(name).itemsize
    return torch_dtype(name).itemsize
