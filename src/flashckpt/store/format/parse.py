"""Parsing a manifest (store/format/manifest.py): every check restore relies on, in one place.

A manifest may come from a damaged disk or a hostile source, so every field is type-checked and
bounded before anything is allocated, and nothing in it ever becomes a path except a validated
chunk hash. ``verify``, ``ls``, ``inspect``, ``restore`` and the distributed commit all parse
through :func:`parse_manifest`, so they accept exactly the same manifests.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, TypeVar

from flashckpt.errors import ManifestError, UnsupportedFormatError
from flashckpt.store.files.jsonfile import depth_of, load_json
from flashckpt.store.files.limits import MAX_CHUNK_BYTES, MAX_MANIFEST_BYTES
from flashckpt.store.format.dtypes import itemsize
from flashckpt.store.format.lineage import parse_lineage
from flashckpt.store.format.manifest import (
    CODECS,
    FORMAT,
    HASH_RE,
    MAX_META_DEPTH,
    MAX_NDIM,
    MAX_SHARDS,
    MAX_STEP,
    MAX_TENSOR_BYTES,
    MAX_TREE_DEPTH,
    READABLE,
    ChunkRef,
    Extent,
    Manifest,
    Shard,
    TensorEntry,
)
from flashckpt.store.format.tiling import check_tiling
from flashckpt.version import __version__

T = TypeVar("T")


def _maker(cls: type[T]) -> Callable[..., T]:
    """A keyword constructor of the frozen dataclass ``cls`` for the parser's hot path: it
    fills the instance's ``__dict__`` at once instead of the frozen ``__init__``'s
    ``object.__setattr__`` per field (1.4 -> 0.8 us each, three per tensor of a manifest: about
    1.7 us of a small tensor's 35-40 us restore, within the 2-vCPU VM's noise end to end).
    Equality, hashing and immutability are the
    dataclass's own. The parser passes every field (tests/store/test_manifest_fast.py checks
    each object against the dataclass's constructor); ``cls`` has no ``__post_init__``."""
    if "__post_init__" in vars(cls):  # its checks would be skipped: use the constructor
        raise TypeError(f"{cls.__name__} validates in __post_init__; no fast constructor")
    new = object.__new__

    def make(**fields: Any) -> T:
        obj = new(cls)
        obj.__dict__.update(fields)
        return obj

    return make


_new_extent = _maker(Extent)
_new_shard = _maker(Shard)
_new_entry = _maker(TensorEntry)


def parse_manifest(data: bytes, *, where: str = "manifest", whole: bool = True) -> Manifest:
    """Parse and validate manifest bytes; raise :class:`ManifestError` on anything suspicious.

    Every check restore relies on happens here, so ``verify``, ``ls``, ``inspect`` and
    ``restore`` accept exactly the same manifests: the schema, the dtype allow-list, chunk
    names, sizes (each tensor at most ``MAX_TENSOR_BYTES``, each chunk ``MAX_CHUNK_BYTES``),
    extents inside their chunks, shards that never overlap and, for a ``whole`` manifest (not a
    rank's part), tile each tensor exactly, and a state tree no deeper than restore decodes.
    """
    # the depth of the free-form parts (tree, rank_trees, stats) is checked below; the rest
    # has a fixed shape that _parse_doc type-checks, so no generic walk over every extent
    doc = load_json(
        data, where=where, max_bytes=MAX_MANIFEST_BYTES, max_depth=None, error=ManifestError
    )
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise ManifestError(f"{where}: not a flashckpt manifest")
    version = doc.get("version")
    if type(version) is int and version > max(READABLE):
        step = doc.get("step")
        raise UnsupportedFormatError(
            f"{where}: written by a newer flashckpt (manifest format version {version}; this "
            f"flashckpt {__version__} reads versions {', '.join(map(str, READABLE))}). It is not "
            "damage and is left as it is: upgrade flashckpt to restore it, or restore an older "
            "step by number (restore(state, step=N))",
            step=step if type(step) is int else None,
            version=version,
        )
    if type(version) is not int or version not in READABLE:
        raise ManifestError(
            f"{where}: format version {version!r} is not supported by this flashckpt "
            f"(reads versions {', '.join(map(str, READABLE))}) and is no version any flashckpt "
            "writes: the manifest is damaged"
        )
    try:
        return _parse_doc(doc, where, whole, compact=version >= 2)
    except ManifestError:
        raise
    except (TypeError, ValueError, KeyError, AttributeError, OverflowError) as exc:
        raise ManifestError(f"{where}: malformed manifest ({type(exc).__name__}: {exc})") from None


def _parse_doc(doc: dict[str, Any], where: str, whole: bool, *, compact: bool) -> Manifest:
    step = _int(doc["step"], "step", 0, MAX_STEP, where)
    chunks = [_parse_chunk(c, where) for c in _list(doc["chunks"], "chunks", where)]
    tensors_doc = doc["tensors"]
    if not isinstance(tensors_doc, dict):
        raise ManifestError(f"{where}: 'tensors' must be an object")
    tensors = {k: _parse_entry(k, v, chunks, where, whole, compact) for k, v in tensors_doc.items()}
    tree = doc.get("tree", {})
    rank_trees = doc.get("rank_trees", {})
    if not isinstance(tree, dict) or not isinstance(rank_trees, dict):
        raise ManifestError(f"{where}: 'tree' and 'rank_trees' must be objects")
    for name, sub in tree.items():
        _check_tree_depth(sub, f"{where}: state tree {name!r}")
    for rank, sub in rank_trees.items():
        _check_tree_depth(sub, f"{where}: rank {rank!r} state tree", start=-1)
    time_s = doc.get("time", 0.0)
    if not isinstance(time_s, (int, float)) or not 0 <= time_s < 1e11:
        raise ManifestError(f"{where}: 'time' {time_s!r} is not a plausible unix time")
    return Manifest(
        step=step,
        time_s=float(time_s),
        world_size=_int(doc.get("world_size", 1), "world_size", 1, 1 << 24, where),
        tree=tree,
        rank_trees=rank_trees,
        tensors=tensors,
        chunks=chunks,
        stats=_stats(doc.get("stats")),
        library=str(doc.get("library", "")),
        meta=_meta(doc.get("meta"), where),
        lineage=parse_lineage(doc["lineage"], where) if "lineage" in doc else None,
    )


def _parse_chunk(c: Any, where: str) -> ChunkRef:
    if not (isinstance(c, list) and len(c) == 4):
        raise ManifestError(f"{where}: chunk entry {c!r} is not [hash, size, codec, stored_size]")
    h, size, codec, stored = c
    if not isinstance(h, str) or not HASH_RE.match(h):
        raise ManifestError(f"{where}: chunk name {h!r} is not a 32-hex-digit hash")
    if codec not in CODECS:
        raise ManifestError(f"{where}: chunk {h} has unknown codec {codec!r}")
    return ChunkRef(
        hash=h,
        size=_int(size, "chunk size", 0, MAX_CHUNK_BYTES, where),
        codec=codec,
        stored_size=_int(stored, "chunk stored size", 0, MAX_CHUNK_BYTES, where),
    )


def _stats(stats: Any) -> dict[str, Any]:
    """Informational numbers: kept only when they are a shallow object."""
    return stats if isinstance(stats, dict) and depth_of(stats, limit=8) <= 8 else {}


def _meta(meta: Any, where: str) -> dict[str, Any]:
    """Entry metadata: an object of objects, no deeper than a state tree."""
    if meta is None:
        return {}
    if not isinstance(meta, dict) or not all(isinstance(v, dict) for v in meta.values()):
        raise ManifestError(f"{where}: 'meta' must be an object of objects")
    if depth_of(meta, limit=MAX_META_DEPTH) > MAX_META_DEPTH:
        raise ManifestError(f"{where}: 'meta' is nested deeper than {MAX_META_DEPTH}")
    return meta


def _check_tree_depth(node: Any, where: str, *, start: int = 0) -> None:
    """Refuse a tree that restore would refuse, without recursion, so ``verify`` fails exactly
    where ``restore`` would. Restore walks the tree twice (``state.tree.tensor_refs``, then
    ``decode_tree``); the first is the stricter count: every list or object is one level, a
    tensor leaf ``{"__t__": key}`` is not descended into, and no value may sit deeper than
    ``MAX_TREE_DEPTH``."""
    stack: list[tuple[Any, int]] = [(node, start)]
    while stack:
        n, d = stack.pop()
        if d > MAX_TREE_DEPTH:
            raise ManifestError(f"{where} is nested deeper than {MAX_TREE_DEPTH}")
        if isinstance(n, list):
            stack.extend((v, d + 1) for v in n)
        elif isinstance(n, dict) and not (len(n) == 1 and ("__t__" in n or "__np__" in n)):
            stack.extend((v, d + 1) for v in n.values())


_ITEMSIZES: dict[tuple[str, str], int] = {}  # (kind, dtype) -> itemsize, once allow-listed


def _parse_entry(
    key: str,
    v: Any,
    chunks: list[ChunkRef],
    where: str,
    whole: bool = True,
    compact: bool = False,
) -> TensorEntry:
    """One tensor's entry. ``compact`` (format version 2): an entry may give ``"extents"``
    instead of ``"shards"``: one shard, the whole tensor, written by rank 0."""
    if type(v) is not dict:
        raise ManifestError(f"{where}: tensor {key!r} entry must be an object")
    kind = v["kind"]
    if kind not in ("torch", "numpy"):
        raise ManifestError(f"{where}: tensor {key!r} has unknown kind {kind!r}")
    dtype = v["dtype"]
    isz = _ITEMSIZES.get((kind, dtype)) if type(dtype) is str else None
    if isz is None:
        isz = _ITEMSIZES[(kind, dtype)] = itemsize(kind, dtype)  # validates: the allow-list
    gshape = _shape(v["global_shape"], key, "global_shape", where)
    if math.prod(gshape) * isz > MAX_TENSOR_BYTES:
        raise ManifestError(f"{where}: tensor {key!r} claims an absurd size {gshape}")
    if compact and "extents" in v:
        if "shards" in v:
            raise ManifestError(
                f"{where}: tensor {key!r} gives both 'shards' and 'extents' (one or the other)"
            )
        extents = _extents(key, v["extents"], math.prod(gshape) * isz, chunks, where)
        whole_shard = _new_shard(offset=(0,) * len(gshape), shape=gshape, extents=extents, rank=0)
        return _new_entry(
            key=key, kind=kind, dtype=dtype, global_shape=gshape, shards=(whole_shard,)
        )
    shards_doc = _list(v["shards"], "shards", where)
    if len(shards_doc) > MAX_SHARDS:
        raise ManifestError(f"{where}: tensor {key!r} has {len(shards_doc)} shards")
    shards = tuple([_parse_shard(key, s, gshape, isz, chunks, where) for s in shards_doc])
    one = len(shards) == 1 and shards[0].shape == gshape and not any(shards[0].offset)
    if not one:  # a single shard at the origin with the global shape tiles exactly
        problem = check_tiling(gshape, [(s.offset, s.shape) for s in shards], whole=whole)
        if problem:
            raise ManifestError(f"{where}: tensor {key!r}: {problem}; refusing to load it")
    return _new_entry(key=key, kind=kind, dtype=dtype, global_shape=gshape, shards=shards)


def _parse_shard(
    key: str, s: Any, gshape: tuple[int, ...], isz: int, chunks: list[ChunkRef], where: str
) -> Shard:
    if type(s) is not dict:
        raise ManifestError(f"{where}: tensor {key!r} has a malformed shard")
    offset = _shape(s["offset"], key, "shard offset", where)
    shape = _shape(s["shape"], key, "shard shape", where)
    if len(offset) != len(gshape) or len(shape) != len(gshape):
        raise ManifestError(f"{where}: tensor {key!r} shard rank differs from its global shape")
    if shape != gshape or any(offset):  # else the shard is the whole tensor: inside it
        for o, n, g in zip(offset, shape, gshape):
            if o + n > g:
                raise ManifestError(f"{where}: tensor {key!r} shard lies outside the global shape")
    extents = _extents(key, s["extents"], math.prod(shape) * isz, chunks, where)
    rank = s.get("rank", 0)
    if not (_is_int(rank) and 0 <= rank <= 1 << 24):
        _int(rank, "shard rank", 0, 1 << 24, where)
    return _new_shard(offset=offset, shape=shape, extents=extents, rank=rank)


def _extents(
    key: str, doc: Any, nbytes: int, chunks: list[ChunkRef], where: str
) -> tuple[Extent, ...]:
    """The extents of one shard of ``nbytes`` bytes: each inside its chunk, adding up."""
    extents = []
    total = 0
    last = len(chunks) - 1
    for x in _list(doc, "extents", where):
        if type(x) is list and len(x) == 3:  # the checks of _extent, inline: once per extent
            ci, off, length = x
            if (
                type(ci) is int
                and type(off) is int
                and type(length) is int
                and 0 <= ci <= last
                and off >= 0
                and length >= 0
                and off + length <= chunks[ci].size  # <= MAX_CHUNK_BYTES, checked per chunk
            ):
                extents.append(_new_extent(chunk=ci, offset=off, length=length))
                total += length
                continue
        _extent(key, x, chunks, where)  # raises, naming what is wrong
    if total != nbytes:
        raise ManifestError(f"{where}: tensor {key!r} extents do not add up to its shard size")
    return tuple(extents)


def _extent(key: str, x: Any, chunks: list[ChunkRef], where: str) -> None:
    """Raise the error of an extent that failed the inline checks of _parse_shard."""
    if type(x) is not list or len(x) != 3:
        raise ManifestError(f"{where}: tensor {key!r} has a malformed extent {x!r}")
    ci, off, length = x
    _int(ci, "extent chunk", 0, len(chunks) - 1, where)
    _int(off, "extent offset", 0, MAX_CHUNK_BYTES, where)
    _int(length, "extent length", 0, MAX_CHUNK_BYTES, where)
    raise ManifestError(
        f"{where}: tensor {key!r} extent runs past the end of chunk {chunks[ci].hash}"
    )


def _is_int(v: Any) -> bool:
    """An int that is not a bool (``type`` is exact: JSON gives only plain ints)."""
    return type(v) is int


def _int(v: Any, what: str, lo: int, hi: int, where: str) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
        raise ManifestError(f"{where}: {what} {v!r} is not an integer in [{lo}, {hi}]")
    return v


def _list(v: Any, what: str, where: str) -> list[Any]:
    if not isinstance(v, list):
        raise ManifestError(f"{where}: '{what}' must be a list")
    return v


def _shape(v: Any, key: str, what: str, where: str) -> tuple[int, ...]:
    """A shape or offset of tensor ``key``: a list of at most MAX_NDIM non-negative ints. The
    message is built only on failure (this runs three times per tensor of the manifest)."""
    if type(v) is list and len(v) <= MAX_NDIM:
        for d in v:
            if type(d) is not int or not 0 <= d <= MAX_TENSOR_BYTES:
                break
        else:
            return tuple(v)
    label = f"tensor {key!r} {what}"
    dims = _list(v, label, where)
    if len(dims) > MAX_NDIM:
        raise ManifestError(f"{where}: {label} has {len(dims)} dimensions")
    return tuple(_int(d, label, 0, MAX_TENSOR_BYTES, where) for d in dims)
