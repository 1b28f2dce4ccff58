"""The manifest's tensor entries are rendered as text (not dict + json.dumps, 10 us a tensor):
the text must parse back to exactly what the entries say, for any key (quotes, backslashes,
control characters, non-ASCII) and any shard layout, and round-trip through the parser."""

from __future__ import annotations

import json
import random

import pytest

from flashckpt.store.format.manifest import (
    ChunkRef,
    Extent,
    Manifest,
    Shard,
    TensorEntry,
    tensors_json,
)
from flashckpt.store.format.parse import parse_manifest


def _whole(e: TensorEntry) -> bool:
    """Format version 2 writes this entry compact: one shard, the whole tensor, rank 0."""
    (s, *more) = e.shards
    return not more and s.rank == 0 and s.shape == e.global_shape and not any(s.offset)


def _extents(s: Shard) -> list:
    return [[x.chunk, x.offset, x.length] for x in s.extents]


def _reference(tensors: dict[str, TensorEntry]) -> dict:
    return {
        k: {
            "kind": e.kind,
            "dtype": e.dtype,
            "global_shape": list(e.global_shape),
            "extents": _extents(e.shards[0]),
        }
        if _whole(e)
        else {
            "kind": e.kind,
            "dtype": e.dtype,
            "global_shape": list(e.global_shape),
            "shards": [
                {
                    "offset": list(s.offset),
                    "shape": list(s.shape),
                    "rank": s.rank,
                    "extents": _extents(s),
                }
                for s in e.shards
            ],
        }
        for k, e in tensors.items()
    }


@pytest.mark.parametrize("seed", range(5))
def test_rendered_entries_parse_back_to_the_entries(seed: int) -> None:
    rng = random.Random(seed)
    keys = ['m/"q"', "m/back\\slash", "m/ctl\n\t\x01", "opt/ü/é", "m/\u2028", "plain"]
    tensors = {}
    for i in range(300):
        key = f"{rng.choice(keys)}/{i}"
        nd = rng.randint(0, 4)
        shards = tuple(
            Shard(
                offset=tuple(rng.randint(0, 5) for _ in range(nd)),
                shape=tuple(rng.randint(0, 5) for _ in range(nd)),
                rank=rng.randint(0, 7),
                extents=tuple(
                    Extent(chunk=rng.randint(0, 3), offset=rng.randint(0, 1 << 40), length=9)
                    for _ in range(rng.randint(0, 3))
                ),
            )
            for _ in range(rng.randint(1, 3))
        )
        gshape = tuple(rng.randint(0, 9) for _ in range(nd))
        if rng.random() < 0.5:  # one shard: the whole tensor (compact unless its rank is not 0)
            s = shards[0]
            shards = (
                Shard(
                    offset=(0,) * nd, shape=gshape, rank=rng.choice([0, 0, 1]), extents=s.extents
                ),
            )
        tensors[key] = TensorEntry(
            key=key,
            kind=rng.choice(["torch", "numpy"]),
            dtype=rng.choice(["float32", "bfloat16", "int64"]),
            global_shape=gshape,
            shards=shards,
        )
    reference = _reference(tensors)
    assert 0 < sum("extents" in e for e in reference.values()) < len(reference)  # both forms
    assert json.loads(tensors_json(tensors)) == reference


def test_a_rendered_manifest_round_trips_through_the_parser() -> None:
    chunk = ChunkRef(hash="0" * 32, size=64 * 3)
    tensors = {
        f'm/"t{i}"\n': TensorEntry(
            key=f'm/"t{i}"\n',
            kind="torch",
            dtype="float32",
            global_shape=(4, 4),
            shards=(
                Shard(
                    offset=(0, 0),
                    shape=(4, 4),
                    extents=(Extent(chunk=0, offset=64 * i, length=64),),
                ),
            ),
        )
        for i in range(3)
    }
    m = Manifest(step=7, time_s=1.0, tensors=tensors, chunks=[chunk], tree={})
    back = parse_manifest(m.to_json())
    assert back.tensors == tensors and back.step == 7
