"""Restore from the memory tiers of other nodes, through the public API (``replicas=1``), on
forked gloo ranks whose nodes are told apart by ``Replication(placement=...)``; each node has its
own memory-tier directory. The disk tier's ``chunks/`` is hidden during the restore, so any read
of a disk chunk fails: a restore that still loads the newest step bitwise read none.
(tests/distributed/test_peer_restore_nodes.py does the same with real torchrun nodes and
SIGKILL.)"""

from __future__ import annotations

import shutil
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from flashckpt import Checkpointer
from flashckpt.engine.options import Replication
from flashckpt.journal import read_events

pytestmark = pytest.mark.dist

STEPS = (1, 2, 3)


@pytest.fixture
def mem_dir(tmp_path: Path) -> Iterator[Path]:
    base = Path("/dev/shm")
    d = base / f"flashckpt-peer-{uuid.uuid4().hex[:12]}" if base.is_dir() else tmp_path / "shm"
    yield d
    shutil.rmtree(d, ignore_errors=True)


def train_state(rank: int, step: int) -> dict[str, Any]:
    """The state after ``step``: a model identical on every rank (DDP-style: each tensor written
    once, by its owner rank) and a per-rank entry (saved by every rank)."""
    torch.manual_seed(1000 + step)
    model = nn.Sequential(*[nn.Linear(48, 48) for _ in range(4)])
    g = torch.Generator().manual_seed(rank * 100 + step)
    data = {"pos": torch.tensor(rank * 1000 + step), "noise": torch.randn(2000, generator=g)}
    return {"model": model, "data": data}


def flat(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    out = {f"model.{k}": v for k, v in state["model"].state_dict().items()}
    out.update({f"data.{k}": v for k, v in state["data"].items()})
    return out


def _options(rank: int, mem: str, per_node: int) -> dict[str, Any]:
    node = rank // per_node
    return {
        "memory_tier": f"{mem}/n{node}",
        "replicas": Replication(placement=lambda r: f"n{r // per_node}", timeout_s=30),
        "fsync": False,
        "dist_timeout_s": 30,
        "chunk_size": "16KiB",
        "keep_memory_after_close": True,  # the tests look at the node tiers after close
    }


def save_job(rank: int, world: int, root: str, mem: str, per_node: int) -> int:
    """Save every step, wait until replicated, then vanish without closing (a crash)."""
    ck = Checkpointer(root, **_options(rank, mem, per_node))
    for step in STEPS:
        ck.save(step, train_state(rank, step)).durable.result(timeout=60)
    if ck._dist is not None and ck._dist.replicator is not None:
        ck._dist.replicator.drain()
    return STEPS[-1]


def restore_job(rank: int, world: int, root: str, mem: str, per_node: int) -> dict[str, Any]:
    with Checkpointer(root, **_options(rank, mem, per_node)) as ck:
        state = train_state(rank, 0)  # different values everywhere
        got = ck.restore(state)
    want = flat(train_state(rank, got)) if got is not None else {}
    have = flat(state)
    events = [e for e in read_events(Path(root)) if e.get("rank") == rank]
    peers = [e for e in events if e["event"] == "restored_from_peers"]
    return {
        "step": got,
        "bitwise": bool(want) and all(torch.equal(want[k], have[k]) for k in want),
        "peer_bytes": peers[-1]["bytes"] if peers else None,
        "tiers": [e["tier"] for e in events if e["event"] == "restore"],
    }


@contextmanager
def disk_chunks_hidden(root: Path) -> Iterator[None]:
    """Any read of a disk-tier chunk fails while inside (the directory is moved away)."""
    chunks, hidden = root / "chunks", root / "chunks.hidden"
    if chunks.exists():
        chunks.rename(hidden)
    else:
        hidden.mkdir(parents=True)
    try:
        yield
    finally:
        if chunks.exists():  # written while hidden: keep both
            for f in chunks.rglob("*"):
                if f.is_file():
                    dst = hidden / f.relative_to(chunks)
                    dst.parent.mkdir(parents=True, exist_ok=True)
                    f.rename(dst)
            shutil.rmtree(chunks)
        hidden.rename(chunks)


def _run(ranks: Any, tmp: Path, job: Any, world: int, *args: Any) -> list[Any]:
    return ranks.ok(ranks(job, world, tmp, *args, timeout_s=120))


def test_a_restarted_job_restores_from_the_node_tiers_without_the_disk(
    ranks: Any, tmp_path: Path, mem_dir: Path
) -> None:
    """Every node's tier survives (a job restart) on a ring of three nodes: each node holds its
    own chunks and its ring predecessor's replicas, and fetches the rest (the replicated tensors
    the third node's rank owns) from the other nodes, not from the disk."""
    root = tmp_path / "ckpt"
    _run(ranks, tmp_path, save_job, 3, str(root), str(mem_dir), 1)
    with disk_chunks_hidden(root):
        res = _run(ranks, tmp_path, restore_job, 3, str(root), str(mem_dir), 1)
    for r in res:
        assert r["step"] == STEPS[-1] and r["bitwise"], r
        assert r["tiers"] == ["memory"] and r["peer_bytes"] > 0, r


@pytest.mark.parametrize("per_node", [1, 2])
def test_a_replacement_node_restores_from_its_peer_without_the_disk(
    ranks: Any, tmp_path: Path, mem_dir: Path, per_node: int
) -> None:
    root, world = tmp_path / "ckpt", 2 * per_node
    _run(ranks, tmp_path, save_job, world, str(root), str(mem_dir), per_node)
    shutil.rmtree(mem_dir / "n1")  # node 1 is lost; its replacement has an empty /dev/shm
    with disk_chunks_hidden(root):
        res = _run(ranks, tmp_path, restore_job, world, str(root), str(mem_dir), per_node)
    for r in res:
        assert r["step"] == STEPS[-1] and r["bitwise"], r
        assert r["tiers"] == ["memory"]
    for r in range(per_node, world):
        assert res[r]["peer_bytes"] > 0, "the replacement node's ranks fetched their chunks"


def test_a_node_lost_with_its_peer_restores_from_the_disk(
    ranks: Any, tmp_path: Path, mem_dir: Path
) -> None:
    root = tmp_path / "ckpt"
    _run(ranks, tmp_path, save_job, 2, str(root), str(mem_dir), 1)
    shutil.rmtree(mem_dir)  # both nodes lost (node 1 and its peer, node 0)
    res = _run(ranks, tmp_path, restore_job, 2, str(root), str(mem_dir), 1)
    disk = sorted(int(p.name[:-5]) for p in (root / "steps").glob("*[0-9].json"))
    for r in res:
        assert r["step"] == disk[-1] and r["bitwise"], r
        assert r["tiers"] == ["local"] and r["peer_bytes"] is None


def fsdp_save_job(rank: int, world: int, root: str, mem: str) -> dict[str, Any]:
    from test_reshard import build, snapshot, train

    net, opt = build(world, seed=0)
    train(net, opt, 2)
    ck = Checkpointer(root, **_options(rank, mem, 1))
    ck.save(2, {"model": net, "optim": opt}).wait(timeout=60)
    if ck._dist is not None and ck._dist.replicator is not None:
        ck._dist.replicator.drain()
    return snapshot(net, opt)  # then vanish without closing (a crash)


def fsdp_restore_job(rank: int, world: int, root: str, mem: str) -> dict[str, Any]:
    from test_reshard import build, snapshot

    net, opt = build(world, seed=5)  # other weights, empty optimizer state
    with Checkpointer(root, **_options(rank, mem, 1)) as ck:
        step = ck.restore({"model": net, "optim": opt})
    peers = [
        e
        for e in read_events(Path(root))
        if e["event"] == "restored_from_peers" and e.get("rank") == rank
    ]
    return {"step": step, "state": snapshot(net, opt), "peer": bool(peers)}


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    return bool(a == b)


def test_fsdp2_shards_of_a_lost_node_come_back_from_its_peer(
    ranks: Any, tmp_path: Path, mem_dir: Path
) -> None:
    root = tmp_path / "ckpt"
    saved = _run(ranks, tmp_path, fsdp_save_job, 2, str(root), str(mem_dir))
    shutil.rmtree(mem_dir / "n1")
    with disk_chunks_hidden(root):
        res = _run(ranks, tmp_path, fsdp_restore_job, 2, str(root), str(mem_dir))
    for r in res:
        assert r["step"] == 2 and r["peer"]
        assert _equal(r["state"], saved[0]), "model shards and optimizer state, bitwise"


def restore_close_job(rank: int, world: int, root: str, mem: str, per_node: int) -> int | None:
    with Checkpointer(root, **_options(rank, mem, per_node)) as ck:
        got = ck.restore(train_state(rank, 0))
    return got  # closed: what the replicator queued was copied before close returned


def test_a_step_restored_from_peers_only_reaches_the_disk_tier_by_close(
    ranks: Any, tmp_path: Path, mem_dir: Path
) -> None:
    """The newest step is in the node tiers only (the job died before its promotion round:
    its manifest is removed from the disk tier); a replacement node restores it from its peer,
    and the next replication round copies it to the disk tier, so closing leaves it there."""
    from flashckpt.store.files.backend import LocalBackend
    from flashckpt.store.store import CheckpointStore, chunk_path, step_name

    root = tmp_path / "ckpt"
    _run(ranks, tmp_path, save_job, 2, str(root), str(mem_dir), 1)
    (root / step_name(STEPS[-1])).unlink()
    shutil.rmtree(mem_dir / "n1")
    got = _run(ranks, tmp_path, restore_close_job, 2, str(root), str(mem_dir), 1)
    assert got == [STEPS[-1]] * 2
    disk = CheckpointStore(LocalBackend(root, fsync=False))
    assert STEPS[-1] in disk.steps(), "the restored step reached the disk tier"
    manifest = disk.load_manifest(STEPS[-1])
    missing = [r.hash for r in manifest.chunks if not (root / chunk_path(r.hash, r.codec)).exists()]
    assert not missing, missing
    with Checkpointer(root, fsync=False) as ck:  # the disk tier alone, one process
        state = train_state(0, 0)
        assert ck.restore(state) == STEPS[-1]
    want = flat(train_state(0, STEPS[-1]))
    assert all(torch.equal(want[k], v) for k, v in flat(state).items())


def reshaped_restore_job(
    rank: int, world: int, root: str, mem: str, per_node: int, saved_world: int
) -> dict[str, Any]:
    with Checkpointer(root, **_options(rank, mem, per_node)) as ck:
        state = train_state(rank, 0)
        got = ck.restore(state)
    src = rank if rank < saved_world else 0  # a rank the saving job lacked: rank 0's entry
    want = flat(train_state(src, got)) if got is not None else {}
    have = flat(state)
    events = [e for e in read_events(Path(root)) if e.get("rank") == rank]
    return {
        "step": got,
        "bitwise": bool(want) and all(torch.equal(want[k], have[k]) for k in want),
        "peer": any(e["event"] == "restored_from_peers" for e in events),
        "tiers": [e["tier"] for e in events if e["event"] == "restore"],
    }


@pytest.mark.parametrize("saved,restored", [(2, 1), (1, 2)], ids=["4to2", "2to4"])
def test_a_changed_world_size_restores_from_the_node_tiers_bitwise(
    ranks: Any, tmp_path: Path, mem_dir: Path, saved: int, restored: int
) -> None:
    """Saved by 2 nodes x ``saved`` ranks, restored by 2 nodes x ``restored`` ranks from the
    same node tiers (each rank reads the shards and per-rank entry it needs), with the disk
    tier's chunks hidden and the newest step only in the node tiers. With more ranks now, it
    reaches the disk tier by close; with fewer, it cannot be copied there whole (the saving
    ranks that are gone wrote chunks no rank copies): journaled, and never half-committed."""
    from flashckpt.store.files.backend import LocalBackend
    from flashckpt.store.store import CheckpointStore, chunk_path, step_name

    root = tmp_path / "ckpt"
    _run(ranks, tmp_path, save_job, 2 * saved, str(root), str(mem_dir), saved)
    (root / step_name(STEPS[-1])).unlink()
    world = 2 * restored
    with disk_chunks_hidden(root):
        res = _run(
            ranks,
            tmp_path,
            reshaped_restore_job,
            world,
            str(root),
            str(mem_dir),
            restored,
            2 * saved,
        )
    for r in res:
        assert r["step"] == STEPS[-1] and r["bitwise"], r
        assert r["tiers"] == ["memory"] and r["peer"], r
    skipped = [e for e in read_events(root) if e["event"] == "promote_failed"]
    disk = CheckpointStore(LocalBackend(root, fsync=False))
    if saved > restored:  # fewer ranks now: the copy to the disk tier would leave holes
        assert skipped and "saved by 4 rank(s)" in skipped[-1]["error"], skipped
        assert STEPS[-1] not in disk.steps()
    else:
        assert not skipped, skipped
        refs = disk.load_manifest(STEPS[-1]).chunks
        assert all((root / chunk_path(r.hash, r.codec)).exists() for r in refs)


def test_a_changed_world_size_without_the_shards_falls_back_to_the_disk_with_a_reason(
    ranks: Any, tmp_path: Path, mem_dir: Path
) -> None:
    """Saved by 2 nodes x 2 ranks; node 1 is lost and node 0's tier has lost its replicas of
    node 1's ranks: 2 nodes x 1 rank cannot assemble any step from the node tiers, so every
    rank journals why and loads the newest step from the disk, bitwise (nothing half-loaded)."""
    from flashckpt.distributed.replication.transfer import rank_chunks
    from flashckpt.store.files.backend import LocalBackend
    from flashckpt.store.store import CheckpointStore, chunk_path

    root = tmp_path / "ckpt"
    _run(ranks, tmp_path, save_job, 4, str(root), str(mem_dir), 2)
    shutil.rmtree(mem_dir / "n1")
    n0 = CheckpointStore(LocalBackend(mem_dir / "n0", fsync=False))
    for s in n0.steps():
        m = n0.load_manifest(s)
        own = {r.hash for q in (0, 1) for r in rank_chunks(m, q)}
        for ref in [r for q in (2, 3) for r in rank_chunks(m, q) if r.hash not in own]:
            (mem_dir / "n0" / chunk_path(ref.hash, ref.codec)).unlink(missing_ok=True)
    res = _run(ranks, tmp_path, reshaped_restore_job, 2, str(root), str(mem_dir), 1, 4)
    for r in res:
        assert r["step"] == STEPS[-1] and r["bitwise"], r
        assert not r["peer"] and r["tiers"][-1] == "local", r
    skipped = [e for e in read_events(root) if e["event"] == "peer_restore_skipped"]
    assert {e["rank"] for e in skipped} == {0, 1}, skipped
    assert STEPS[-1] in {e["step"] for e in skipped}
    assert all("on no node's memory tier" in e["reason"] for e in skipped), skipped


def resume_job(rank: int, world: int, root: str, mem: str, per_node: int) -> int | None:
    """Restore, then save three newer steps (keep_memory=1) and close."""
    with Checkpointer(root, keep_memory=1, **_options(rank, mem, per_node)) as ck:
        got = ck.restore(train_state(rank, 0))
        for step in (4, 5, 6):
            ck.save(step, train_state(rank, step)).durable.result(timeout=60)
        ck._dist.replicator.drain()
    return got


def test_replicas_of_a_lost_node_are_freed_by_retention_as_new_steps_commit(
    ranks: Any, tmp_path: Path, mem_dir: Path
) -> None:
    """Node 0's tier holds replicas of node 1's rank for steps 1-3; node 1 is replaced and the
    job goes on: as newer steps commit, retention drops the old steps and every chunk no kept
    step names (the old replicas among them) is collected; the replica store stays bounded."""
    from flashckpt.distributed.replication.transfer import rank_chunks
    from flashckpt.store.files.backend import LocalBackend
    from flashckpt.store.store import CheckpointStore, chunk_path

    root = tmp_path / "ckpt"
    _run(ranks, tmp_path, save_job, 2, str(root), str(mem_dir), 1)
    n0 = CheckpointStore(LocalBackend(mem_dir / "n0", fsync=False))
    old = {
        (r.hash, r.codec)
        for s in n0.steps()
        for r in rank_chunks(n0.load_manifest(s), 1)
        if (mem_dir / "n0" / chunk_path(r.hash, r.codec)).exists()
    }
    assert old, "node 0 held replicas of rank 1"
    shutil.rmtree(mem_dir / "n1")
    assert _run(ranks, tmp_path, resume_job, 2, str(root), str(mem_dir), 1) == [STEPS[-1]] * 2
    kept = n0.steps()
    assert kept and min(kept) > STEPS[-1], kept
    named = {(r.hash, r.codec) for s in kept for r in n0.load_manifest(s).chunks}
    left = {x for x in old if (mem_dir / "n0" / chunk_path(*x)).exists()}
    assert left <= named, f"{len(left - named)} old replica chunk(s) outlived their steps"


def test_a_newest_step_the_node_tiers_cannot_assemble_comes_from_the_disk_not_an_older_one(
    ranks: Any, tmp_path: Path, mem_dir: Path
) -> None:
    """Node 1 is lost and node 0 lacks its replicas of the newest step only: the older steps
    could still be assembled from the node tiers, but the disk tier holds the newest, so every
    rank loads that one from the disk (no progress lost for a faster read)."""
    from flashckpt.distributed.replication.transfer import rank_chunks
    from flashckpt.store.files.backend import LocalBackend
    from flashckpt.store.store import CheckpointStore, chunk_path

    root = tmp_path / "ckpt"
    _run(ranks, tmp_path, save_job, 2, str(root), str(mem_dir), 1)
    shutil.rmtree(mem_dir / "n1")
    n0 = CheckpointStore(LocalBackend(mem_dir / "n0", fsync=False))
    assert len(n0.steps()) > 1, "an older step is in the node tiers too"
    older = {r.hash for s in n0.steps() if s != STEPS[-1] for r in n0.load_manifest(s).chunks}
    newest = n0.load_manifest(STEPS[-1])
    own = {r.hash for r in rank_chunks(newest, 0)} | older
    gone = [r for r in rank_chunks(newest, 1) if r.hash not in own]
    assert gone
    for ref in gone:
        (mem_dir / "n0" / chunk_path(ref.hash, ref.codec)).unlink(missing_ok=True)
    res = _run(ranks, tmp_path, restore_job, 2, str(root), str(mem_dir), 1)
    for r in res:
        assert r["step"] == STEPS[-1] and r["bitwise"], r
        assert r["tiers"] == ["local"] and r["peer_bytes"] is None, r
