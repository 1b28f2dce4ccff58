"""The manifest's ``tensors`` as JSON text, rendered straight from the entries (what
:meth:`~flashckpt.store.format.manifest.Manifest.to_json` writes)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from json.encoder import encode_basestring_ascii  # type: ignore[attr-defined]
from typing import Any

# the entries are manifest.TensorEntry / Extent, typed Any here: manifest.py imports this module


def tensors_json(tensors: Mapping[str, Any]) -> str:
    """The JSON text of a manifest's ``tensors`` (what :meth:`Manifest.to_json` writes),
    rendered as text straight from the entries: building a dict per tensor for ``json.dumps``
    cost 10 us per tensor, most of a small tensor's save. Keys are escaped by the encoder
    ``json.dumps`` itself uses; every other value is an int or an allow-listed name. An entry
    whose one shard is the whole tensor, written by rank 0, is written compact (format version
    2: its extents, no shard object)."""
    return "{" + ",".join([_entry_text(k, e) for k, e in tensors.items()]) + "}"


def _ints(xs: tuple[int, ...]) -> str:
    return ",".join([str(int(x)) for x in xs])


def _extents(xs: Sequence[Any]) -> str:
    return ",".join([f"[{x.chunk:d},{x.offset:d},{x.length:d}]" for x in xs])


def _entry_text(key: str, e: Any) -> str:
    head = (
        f'{encode_basestring_ascii(key)}:{{"kind":{encode_basestring_ascii(e.kind)},'
        f'"dtype":{encode_basestring_ascii(e.dtype)},"global_shape":[{_ints(e.global_shape)}],'
    )
    if len(e.shards) == 1:
        s = e.shards[0]
        if s.rank == 0 and s.shape == e.global_shape and not any(s.offset):  # the whole tensor
            return f'{head}"extents":[{_extents(s.extents)}]}}'
    shards = ",".join(
        [
            f'{{"offset":[{_ints(s.offset)}],"shape":[{_ints(s.shape)}],"rank":{s.rank:d},'
            f'"extents":[{_extents(s.extents)}]}}'
            for s in e.shards
        ]
    )
    return f'{head}"shards":[{shards}]}}'
