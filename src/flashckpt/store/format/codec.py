"""Chunk hashing and encoding.

A chunk is named by the xxh3-128 hash of its *raw* bytes, whatever codec stores it, so the same
content is recognised across saves and codecs. ``zstd+shufN`` byte-shuffles N-byte elements
before zstd (the exponent bytes of floats then compress together).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import xxhash
import zstandard

from flashckpt.errors import ConfigError, CorruptCheckpointError
from flashckpt.store.files.backend import Buffer

ZSTD_LEVEL = 3


def hasher() -> Any:
    """A fresh streaming xxh3-128 (``update(buf)``, ``hexdigest()``): the chunk hash."""
    return xxhash.xxh3_128()


def hash_parts(parts: Sequence[Buffer]) -> str:
    """xxh3-128 of the concatenation of ``parts`` (hex, 32 digits)."""
    h = xxhash.xxh3_128()
    for p in parts:
        h.update(p)
    return h.hexdigest()


def choose_codec(compression: str | None, itemsize: int) -> str:
    if compression is None:
        return "raw"
    if compression != "zstd":
        raise ConfigError(f"compression={compression!r} is not supported; use None or 'zstd'")
    return f"zstd+shuf{itemsize}" if itemsize in (2, 4, 8) else "zstd"


def encode(parts: Sequence[Buffer], codec: str) -> list[Buffer]:
    """The bytes to store for a chunk whose raw content is ``parts``."""
    if codec == "raw":
        return list(parts)
    raw = b"".join(memoryview(p).cast("B") for p in parts)
    if codec.startswith("zstd+shuf"):
        raw = _shuffle(raw, int(codec[len("zstd+shuf") :]))
    return [zstandard.ZstdCompressor(level=ZSTD_LEVEL).compress(raw)]


def decode(stored: bytes, codec: str, size: int, *, chunk: str) -> bytes:
    """Raw bytes of a stored chunk; refuses to inflate past the manifest's size."""
    if codec == "raw":
        return stored
    try:
        raw = zstandard.ZstdDecompressor().decompress(stored, max_output_size=size)
    except zstandard.ZstdError as exc:
        raise CorruptCheckpointError(
            f"chunk {chunk} does not decompress: {exc}", chunk=chunk
        ) from None
    if codec.startswith("zstd+shuf"):
        raw = _unshuffle(raw, int(codec[len("zstd+shuf") :]))
    return raw


def _shuffle(raw: bytes, n: int) -> bytes:
    if len(raw) % n:
        return (
            raw[:0] + _shuffle(raw[: len(raw) - len(raw) % n], n) + raw[len(raw) - len(raw) % n :]
        )
    a = np.frombuffer(raw, dtype=np.uint8).reshape(-1, n)
    return a.T.tobytes()


def _unshuffle(raw: bytes, n: int) -> bytes:
    tail = len(raw) % n
    body = raw[: len(raw) - tail]
    a = np.frombuffer(body, dtype=np.uint8).reshape(n, -1)
    return a.T.tobytes() + raw[len(raw) - tail :]
