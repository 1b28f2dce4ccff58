"""peerfetch on real gloo ranks, each with its own memory-tier directory (or two ranks sharing
one): chunks move once per tier, from the holders, verified; a holder sending damaged bytes is
journaled and not used again; a chunk nobody holds is a clear error on every rank."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from flashckpt.distributed.replication.peerfetch import (
    PeerFetchError,
    fetch_chunks,
    present,
    tier_identity,
)
from flashckpt.journal import Journal, read_events
from flashckpt.store.files.backend import LocalBackend
from flashckpt.store.format import codec as codecs
from flashckpt.store.format.manifest import ChunkRef
from flashckpt.store.store import CheckpointStore, chunk_path

pytestmark = pytest.mark.dist


def _blob(name: str, n: int = 3000) -> bytes:
    return (name.encode() * (n // len(name) + 1))[:n]


def _ref(data: bytes, codec: str = "raw") -> ChunkRef:
    h = codecs.hash_parts([data])
    stored = codecs.encode([data], codec)
    return ChunkRef(hash=h, size=len(data), codec=codec, stored_size=len(stored[0]))


BLOBS = {name: _blob(name) for name in ("alpha", "beta", "gamma", "delta", "eps", "zeta")}
REFS = {name: _ref(data) for name, data in BLOBS.items()}
ZREF = _ref(_blob("zipped", 20000), "zstd")  # a compressed chunk travels as stored


def _store(d: Path) -> CheckpointStore:
    d.mkdir(parents=True, exist_ok=True)
    return CheckpointStore(LocalBackend(d, fsync=False))


def _put(store: CheckpointStore, name: str) -> None:
    if name == "zipped":
        store.put_chunk(ZREF.hash, ZREF.size, [_blob("zipped", 20000)], "zstd")
        return
    store.put_chunk(REFS[name].hash, REFS[name].size, [BLOBS[name]], "raw")


def _plant_damaged(store: CheckpointStore, name: str) -> None:
    """A copy of the right size whose bytes do not match its hash (a bit flip in /dev/shm)."""
    bad = bytearray(BLOBS[name])
    bad[7] ^= 0x01
    store.backend.put(chunk_path(REFS[name].hash, "raw"), [bytes(bad)])


def _unreadable(store: CheckpointStore, ref: ChunkRef) -> None:
    """Reading this chunk fails (an I/O error) although its file is there."""
    real = store.backend.read_into

    def read_into(path: str, out: memoryview, **kw: Any) -> int:
        if path == chunk_path(ref.hash, ref.codec):
            raise OSError(5, "Input/output error")
        return real(path, out, **kw)

    store.backend.read_into = read_into  # type: ignore[method-assign]


def fetch_job(rank: int, world: int, tmp: str, spec: dict[str, Any]) -> dict[str, Any]:
    import torch.distributed as dist

    tier = Path(tmp) / spec["dirs"][rank]
    store = _store(tier)
    for name in spec["have"].get(str(rank), []):
        _put(store, name)
    for name in spec.get("damaged", {}).get(str(rank), []):
        _plant_damaged(store, name)
    for name in spec.get("unreadable", {}).get(str(rank), []):
        _unreadable(store, REFS[name])
    dist.barrier()  # every tier is populated before anyone looks
    refs = [ZREF if n == "zipped" else REFS[n] for n in spec["need"]]
    journal = Journal(tier / "journal.jsonl", rank=rank)
    try:
        stats = fetch_chunks(
            dist.group.WORLD,
            store,
            refs,
            step=7,
            tier=tier_identity(tier),
            journal=journal,
            max_inflight_bytes=spec.get("limit", 1 << 20),
        )
    except PeerFetchError as exc:
        return {"error": str(exc), "chunk": exc.chunk, "step": exc.step}
    damaged = spec.get("damaged", {}).get(str(rank), [])
    good = all(
        n in damaged
        or (present(store, r) and store.read_chunk(r) == (BLOBS.get(n) or _blob("zipped", 20000)))
        for n, r in zip(spec["need"], refs)
    )
    return {
        "good": good,
        "received": stats.received_chunks,
        "sources": stats.sources,
        "damaged": stats.damaged,
        "rounds": stats.rounds,
        "sent": stats.sent_chunks,
        "events": [e for e in read_events(tier / "journal.jsonl") if e["event"] == "corrupt"],
        "quarantined": sorted(p.name.split(".")[0] for p in (tier / "quarantine").glob("*")),
    }


def test_each_tier_fetches_what_it_lacks_from_the_holders(ranks: Any, tmp_path: Path) -> None:
    spec = {
        "dirs": ["t0", "t1", "t2"],
        "have": {"0": ["alpha", "beta", "zipped"], "1": ["gamma"], "2": ["alpha"]},
        "need": ["alpha", "beta", "gamma", "zipped"],
        "limit": 1,  # one transfer in flight at a time still completes
    }
    res = ranks.ok(ranks(fetch_job, 3, tmp_path, str(tmp_path), spec))
    assert all(r["good"] for r in res)
    assert res[0]["received"] == 1 and res[0]["sources"] == {1: 3000}
    assert res[1]["received"] == 3 and set(res[1]["sources"]) <= {0, 2}
    assert res[2]["received"] == 3
    assert sum(r["sent"] for r in res) == 7


def test_ranks_sharing_a_tier_fetch_each_chunk_once(ranks: Any, tmp_path: Path) -> None:
    spec = {
        "dirs": ["node0", "node0", "node1"],  # ranks 0 and 1 share one tier directory
        "have": {"2": ["alpha", "beta", "gamma", "delta"]},
        "need": ["alpha", "beta", "gamma", "delta"],
    }
    res = ranks.ok(ranks(fetch_job, 3, tmp_path, str(tmp_path), spec))
    assert all(r["good"] for r in res)
    assert res[0]["received"] == 2 and res[1]["received"] == 2, "spread over the node's ranks"
    assert res[2]["sent"] == 4 and res[2]["received"] == 0


def test_damaged_bytes_from_a_holder_are_refused_and_it_is_not_used_again(
    ranks: Any, tmp_path: Path
) -> None:
    spec = {
        "dirs": ["t0", "t1", "t2"],
        "have": {"2": ["alpha", "beta"]},
        "damaged": {"1": ["alpha"]},  # rank 1's copy of alpha is damaged; it is asked first
        "need": ["alpha", "beta"],
    }
    res = ranks.ok(ranks(fetch_job, 3, tmp_path, str(tmp_path), spec))
    assert res[0]["good"]
    assert [d["holder"] for d in res[0]["damaged"]] == [1]
    assert res[0]["damaged"][0]["chunk"] == REFS["alpha"].hash
    assert res[0]["sources"] == {2: 6000}
    assert res[0]["rounds"] == 2
    (event,) = res[0]["events"]
    assert event["tier"] == "peer" and event["chunk"] == REFS["alpha"].hash and event["step"] == 7
    assert res[1]["quarantined"] == [REFS["alpha"].hash], "the holder quarantines its copy"


def test_a_holder_that_cannot_read_its_copy_declines_and_another_sends_it(
    ranks: Any, tmp_path: Path
) -> None:
    spec = {
        "dirs": ["t0", "t1", "t2"],
        "have": {"1": ["alpha"], "2": ["alpha"]},
        "unreadable": {"1": ["alpha"]},  # rank 1 is asked first (tie on bytes, lowest rank)
        "need": ["alpha"],
    }
    res = ranks.ok(ranks(fetch_job, 3, tmp_path, str(tmp_path), spec))
    assert res[0]["good"] and res[0]["sources"] == {2: 3000}
    assert res[0]["rounds"] == 2 and res[0]["damaged"] == [], "declining is not damage"


def test_a_chunk_only_a_damaged_holder_has_is_an_error_on_every_rank(
    ranks: Any, tmp_path: Path
) -> None:
    spec = {
        "dirs": ["t0", "t1"],
        "have": {"1": ["beta"]},
        "damaged": {"1": ["alpha"]},
        "need": ["alpha", "beta"],
    }
    res = ranks.ok(ranks(fetch_job, 2, tmp_path, str(tmp_path), spec))
    for r in res:
        assert r["chunk"] == REFS["alpha"].hash and r["step"] == 7
        assert "damaged" in r["error"] and "disk or remote" in r["error"]


def test_a_chunk_no_one_holds_is_an_error_naming_it_and_the_step(
    ranks: Any, tmp_path: Path
) -> None:
    spec = {
        "dirs": ["t0", "t1", "t2"],
        "have": {"1": ["alpha"]},
        "need": ["alpha", "eps"],
    }
    res = ranks.ok(ranks(fetch_job, 3, tmp_path, str(tmp_path), spec))
    for r in res:
        assert r["chunk"] == REFS["eps"].hash and r["step"] == 7
        assert f"chunk {REFS['eps'].hash} of step 7" in r["error"]
        assert "no other node's memory tier holds it" in r["error"]
