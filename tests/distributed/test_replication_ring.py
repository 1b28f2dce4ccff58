"""Peer replication rounds on forked gloo ranks, nodes simulated with Replication(placement=...):
each node tier ends up holding its peer's chunks, unchanged chunks are never sent again, a
peer that stops answering journals replication_failed without marking anything replicated, and
retention bounds the replica."""

from __future__ import annotations

import shutil
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from flashckpt import Checkpointer
from flashckpt.cli import main
from flashckpt.distributed.replication.record import replicated_steps
from flashckpt.engine.options import Replication
from flashckpt.journal import read_events
from flashckpt.store.files.backend import LocalBackend
from flashckpt.store.store import CheckpointStore

pytestmark = pytest.mark.dist


@pytest.fixture
def shm(tmp_path: Path) -> Iterator[Path]:
    base = Path("/dev/shm")
    d = base / f"flashckpt-ring-{uuid.uuid4().hex[:12]}" if base.is_dir() else tmp_path / "shm"
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _model() -> nn.Module:
    torch.manual_seed(0)  # the same model on every rank; each weight is its own chunk (>1MiB)
    return nn.Sequential(*[nn.Linear(512, 600) for _ in range(4)])


def _open(root: str, shm: str, rank: int, per_node: int, **kw: Any) -> Checkpointer:
    rep = Replication(placement=lambda r: f"n{r // per_node}", timeout_s=kw.pop("timeout_s", 20))
    return Checkpointer(
        root,
        memory_tier=f"{shm}/n{rank // per_node}",
        replicas=rep,
        fsync=False,
        dist_timeout_s=30,
        keep_memory_after_close=kw.pop("keep_memory_after_close", True),  # tests look at the tiers
        **kw,
    )


def ring_job(rank: int, world: int, root: str, shm: str, per_node: int) -> dict[str, Any]:
    from flashckpt.store.files.remote import FsspecBackend

    model = _model()
    remote = f"memory://flashckpt-ring/{Path(shm).name}"  # fsspec's in-process store: rank 0's
    with _open(root, shm, rank, per_node, keep_memory=1, remote=remote) as ck:
        assert ck._dist is not None and ck._dist.replicator is not None
        for step in (1, 2, 3):
            if step > 1:
                with torch.no_grad():
                    model[step].weight.add_(1.0)  # one chunk changes per step
            ck.save(step, {"model": model})
            ck._dist.replicator.drain()  # no step skipped: each round sees the one before
        sent = {r.step: r.sent_bytes for r in ck._dist.replicator.history}
        ck.wait_promoted(30)
    return {"sent": sent, "remote": CheckpointStore(FsspecBackend(remote)).steps()}


@pytest.mark.parametrize("per_node", [1, 2])
def test_each_node_holds_its_peers_chunks_and_unchanged_chunks_are_not_resent(
    ranks: Any, tmp_path: Path, shm: Path, per_node: int, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "ckpt"
    world = 2 * per_node
    results = ranks.ok(ranks(ring_job, world, tmp_path, str(root), str(shm), per_node))
    tiers = [CheckpointStore(LocalBackend(shm / f"n{i}")) for i in (0, 1)]
    m3 = tiers[0].load_manifest(3)
    for i, store in enumerate(tiers):
        assert store.steps() == [3], "keep_memory=1 counts replicated steps"
        held = set(store.liveness.index())
        assert held == {c.hash for c in m3.chunks}, f"node {i}: own + peer chunks of step 3 only"
        assert replicated_steps(shm / f"n{i}") == {3}, "older records pruned with their steps"
    disk = CheckpointStore(LocalBackend(root))
    assert 3 in disk.steps(), "the ranks promoted the node-local step to the disk tier"
    events = [e for e in read_events(root) if e["event"] == "replicated"]
    assert [e["step"] for e in events] == [1, 2, 3], events
    by_step = {e["step"]: e["bytes"] for e in events}
    chunk = 600 * 512 * 4  # one changed weight
    assert by_step[2] == by_step[3] == chunk, by_step
    assert by_step[1] > 4 * chunk, "the first step sends everything"
    assert sum(r["sent"][2] for r in results) == chunk
    assert results[0]["remote"] == [1, 2, 3], "rank 0 promotes from the disk tier to the remote"
    assert main(["ls", str(root)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert any(ln.startswith("3 ") and "memory,local (replicated)" in ln for ln in lines), lines
    assert main(["status", str(root)]) == 0
    assert "peer replication: 3 step(s) replicated (newest 3), 0 failed" in capsys.readouterr().out


def skipping_job(rank: int, world: int, root: str, shm: str) -> list[int]:
    from flashckpt.distributed.replication import transfer

    real = transfer.Exchange.chunks
    slow = {"first": True}

    def chunks(self: Any, *a: Any) -> int:
        if slow.pop("first", False):
            time.sleep(3.0)  # step 1's round is still running while steps 2 and 3 commit
        return real(self, *a)

    transfer.Exchange.chunks = chunks  # type: ignore[method-assign]
    model = _model()
    with _open(root, shm, rank, 1) as ck:
        for step in (1, 2, 3):
            with torch.no_grad():
                model[0].weight.add_(1.0)
            ck.save(step, {"model": model})
    return sorted(replicated_steps(Path(shm) / f"n{rank}"))


def test_a_step_committed_while_replication_runs_is_skipped_for_the_newest(
    ranks: Any, tmp_path: Path, shm: Path
) -> None:
    root = tmp_path / "ckpt"
    results = ranks.ok(ranks(skipping_job, 2, tmp_path, str(root), str(shm)))
    assert results == [[1, 3], [1, 3]]
    skipped = [e for e in read_events(root) if e["event"] == "replication_skipped"]
    assert [e["steps"] for e in skipped] == [[2]] and skipped[0]["newer"] == 3


def stalled_peer_job(rank: int, world: int, root: str, shm: str) -> dict[str, Any]:
    from flashckpt.distributed.replication import transfer

    real = transfer.Exchange.chunks
    calls = {"n": 0}

    def chunks(self: Any, *a: Any) -> int:
        calls["n"] += 1
        if rank == 1 and calls["n"] == 2:
            time.sleep(6.0)  # node n1 stops answering during step 2's round
        return real(self, *a)

    transfer.Exchange.chunks = chunks  # type: ignore[method-assign]
    model = _model()
    with _open(root, shm, rank, 1, timeout_s=2) as ck:
        assert ck._dist is not None and ck._dist.replicator is not None
        for step in (1, 2, 3, 4):
            with torch.no_grad():
                model[0].weight.add_(1.0)
            ck.save(step, {"model": model})
            if step <= 2:
                ck._dist.replicator.drain()
        tiers = {s: [t.name for t in ck._tiers.tiers if s in t.store.steps()] for s in (3, 4)}
    return {"replicated": sorted(replicated_steps(Path(shm) / f"n{rank}")), "tiers": tiers}


def test_a_peer_that_stops_answering_journals_replication_failed_and_saves_go_on(
    ranks: Any, tmp_path: Path, shm: Path
) -> None:
    root = tmp_path / "ckpt"
    results = ranks.ok(ranks(stalled_peer_job, 2, tmp_path, str(root), str(shm), timeout_s=90))
    for r in results:
        assert r["replicated"] == [1], "step 2 is not marked replicated"
        assert r["tiers"][4] == ["local"], "saves after the stop go to the disk tier"
    failed = [e for e in read_events(root) if e["event"] == "replication_failed"]
    assert failed and all(e["stopped"] for e in failed), failed
    assert {e["step"] for e in failed} == {2}
    assert not [e for e in read_events(root) if e["event"] == "replicated" and e["step"] != 1]


def damaged_send_job(rank: int, world: int, root: str, shm: str) -> list[int]:
    from flashckpt.distributed.replication import replicate

    real = replicate.Replicator._reader
    rounds = {"n": 0}

    def reader(self: Any, step: int) -> Any:
        read = real(self, step)
        rounds["n"] += 1
        if rank != 0 or rounds["n"] != 1:
            return read

        def flipped(ref: Any, out: memoryview) -> None:
            read(ref, out)
            out[0] ^= 0xFF  # a bit flipped on the way: the receiver must refuse it

        return flipped

    replicate.Replicator._reader = reader  # type: ignore[method-assign]
    model = _model()
    with _open(root, shm, rank, 1) as ck:
        assert ck._dist is not None and ck._dist.replicator is not None
        for step in (1, 2):
            with torch.no_grad():
                model[0].weight.add_(1.0)
            ck.save(step, {"model": model})
            ck._dist.replicator.drain()
    return sorted(replicated_steps(Path(shm) / f"n{rank}"))


def test_a_chunk_damaged_in_transit_is_refused_and_the_step_not_marked_replicated(
    ranks: Any, tmp_path: Path, shm: Path
) -> None:
    root = tmp_path / "ckpt"
    results = ranks.ok(ranks(damaged_send_job, 2, tmp_path, str(root), str(shm)))
    assert results == [[2], [2]], "step 1 is not replicated; the next round works"
    failed = [e for e in read_events(root) if e["event"] == "replication_failed"]
    assert [(e["step"], e["stopped"]) for e in failed] == [(1, False)], failed
    n1 = CheckpointStore(LocalBackend(shm / "n1"))
    held = set(n1.liveness.index())
    refs = {r.hash: r for s in (1, 2) for r in n1.load_manifest(s).chunks if r.hash in held}
    assert len(refs) > 4
    for ref in refs.values():
        n1.read_chunk(ref)  # raises CorruptCheckpointError on a damaged copy
