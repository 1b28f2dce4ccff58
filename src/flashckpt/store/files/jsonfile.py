"""JSON from disk, with limits: the one parser for manifests, tiers.json, the root id, journal
lines and the run marker.

Any of those files may be damaged or planted. ``json.loads`` alone turns a nesting bomb into a
``RecursionError`` (or, a little below the interpreter's limit, a document that crashes the
next recursive walker), and accepts values of any type. :func:`load_json` bounds the size, the
nesting depth (checked without recursion), the number of objects and lists (counted before
parsing: a file of empty objects costs Python twenty times its size) and refuses
``NaN``/``Infinity`` and any object with a duplicate key (``json.loads`` keeps the last one
silently, so two readers, or a reader and a human, could see different documents); every
failure is the caller's :class:`~flashckpt.errors.FlashCkptError`
subclass naming the file.
"""

from __future__ import annotations

import json
from typing import Any

from flashckpt.errors import FlashCkptError

DEFAULT_MAX_DEPTH = 32
# Containers ("{" and "[") allowed per file: a fixed allowance plus one per 16 bytes. A real
# manifest spends well over 16 bytes per object or list (names, numbers); a file of empty
# objects spends 3, and each costs Python 50-60 bytes: 48 MiB of ``{},`` would be 1.5 GB.
BASE_CONTAINERS = 1 << 16
BYTES_PER_CONTAINER = 16


def container_limit(nbytes: int) -> int:
    return BASE_CONTAINERS + nbytes // BYTES_PER_CONTAINER


def _no_constants(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    doc = dict(pairs)  # C speed; the slow search only for a document that has a duplicate
    if len(doc) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise ValueError(f"duplicate key {key[:100]!r} in one object")
            seen.add(key)
    return doc


def depth_of(doc: Any, *, limit: int) -> int:
    """The nesting depth of a parsed JSON value (a scalar is 0), computed without recursion;
    stops counting once ``limit`` is exceeded and returns ``limit + 1``."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(doc, 0)]
    while stack:
        node, d = stack.pop()
        if isinstance(node, dict):
            children: Any = node.values()
        elif isinstance(node, list):
            children = node
        else:
            continue
        d += 1
        if d > limit:
            return limit + 1
        deepest = max(deepest, d)
        stack.extend((c, d) for c in children if isinstance(c, (dict, list)))
    return deepest


def load_json(
    data: bytes | str,
    *,
    where: str,
    max_bytes: int,
    max_depth: int | None = DEFAULT_MAX_DEPTH,
    error: type[FlashCkptError] = FlashCkptError,
    allow_nan: bool = False,
) -> Any:
    """Parse ``data``; raise ``error(message naming where)`` when it is larger than
    ``max_bytes``, not JSON, uses NaN/Infinity (unless ``allow_nan``), or nests deeper than
    ``max_depth`` (None: the caller checks the structure itself)."""
    if len(data) > max_bytes:
        raise error(f"{where}: {len(data)} bytes is larger than any valid file of this kind")
    raw = data.encode("utf-8", "surrogatepass") if isinstance(data, str) else data
    # an upper bound on the objects and lists it holds (brackets inside strings count too),
    # found without parsing: the element count is bounded before a single one is built
    containers = raw.count(b"{") + raw.count(b"[")
    if containers > container_limit(len(raw)):
        raise error(
            f"{where}: {containers} objects and lists in {len(raw)} bytes; no flashckpt file "
            "is built like that (refusing to parse it)"
        )
    try:
        doc = json.loads(
            data,
            parse_constant=None if allow_nan else _no_constants,
            object_pairs_hook=_unique_keys,
        )
    except RecursionError:
        raise error(f"{where}: JSON nested too deeply to be a flashckpt file") from None
    except (ValueError, UnicodeDecodeError, TypeError) as exc:
        raise error(f"{where}: not valid JSON ({str(exc)[:200]})") from None
    # nesting never exceeds the number of objects and lists: a flat document (a journal line)
    # needs no walk
    if (
        max_depth is not None
        and containers > max_depth
        and depth_of(doc, limit=max_depth) > max_depth
    ):
        raise error(f"{where}: JSON nested deeper than {max_depth} levels")
    return doc


def load_object(
    data: bytes | str,
    *,
    where: str,
    max_bytes: int,
    max_depth: int = DEFAULT_MAX_DEPTH,
    error: type[FlashCkptError] = FlashCkptError,
    allow_nan: bool = False,
) -> dict[str, Any]:
    """Like :func:`load_json`, for documents that must be a JSON object."""
    doc = load_json(
        data,
        where=where,
        max_bytes=max_bytes,
        max_depth=max_depth,
        error=error,
        allow_nan=allow_nan,
    )
    if not isinstance(doc, dict):
        raise error(f"{where}: expected a JSON object, found {type(doc).__name__}")
    return doc
