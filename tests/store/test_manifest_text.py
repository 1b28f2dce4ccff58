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


def _reference(tensors: dict[str, TensorEntry]) -> dict:
    return {
        k: {
            "kind": e.kind,
            "dtype": e.dtype,
            "global_shape": list(e.global_shape),
            "shards": [
                {
                    "offset": list(s.offset),
                    "shape": list(s.shape),
                    "rank": s.rank,
                    "extents": [[x.chunk, x.offset, x.length] for x in s.extents],
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
        tensors[key] = TensorEntry(
            key=key,
            kind=rng.choice(["torch", "numpy"]),
            dtype=rng.choice(["float32", "bfloat16", "int64"]),
            global_shape=tuple(rng.randint(0, 9) for _ in range(nd)),
            shards=shards,
        )
    assert json.loads(tensors_json(tensors)) == _reference(tensors)


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
