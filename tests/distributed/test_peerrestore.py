"""The restore from peers (distributed/replication/peerrestore.py through distributed/restore.py)
on real gloo ranks with hand-made node tiers: one checkpoint's chunks spread over two node
directories (one of them without the manifest, like a node whose manifest was lost), and a disk
tier with older steps."""

from __future__ import annotations

import shutil
from contextlib import nullcontext
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch

from flashckpt import Checkpointer
from flashckpt.distributed.group.context import DistContext
from flashckpt.distributed.replication.peerfetch import tier_identity
from flashckpt.distributed.replication.peerrestore import PeerSource, peer_candidates
from flashckpt.distributed.restore import restore_agreed
from flashckpt.engine.restore.load import Attempt, load_step
from flashckpt.errors import CorruptCheckpointError, StorageError
from flashckpt.journal import Journal, read_events
from flashckpt.store.files.backend import LocalBackend
from flashckpt.store.store import CheckpointStore, chunk_path, step_name

pytestmark = pytest.mark.dist


def _state(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {"model": {"w": torch.randn(64, 64, generator=g), "b": torch.randn(3000, generator=g)}}


def _save(root: Path, step: int, seed: int) -> None:
    with Checkpointer(root, fsync=False, chunk_size="8KiB") as ck:
        ck.save(step, _state(seed))


def _store(d: Path) -> CheckpointStore:
    d.mkdir(parents=True, exist_ok=True)
    return CheckpointStore(LocalBackend(d, fsync=False))


def _spread(src: Path, step: int, nodes: list[Path], *, drop: int = -1) -> None:
    """Step ``step`` of ``src``: manifest into node 0 only, chunk i into node i % 2 (chunk
    ``drop`` into none)."""
    m = _store(src).load_manifest(step)
    for d in nodes:
        _store(d)
    (nodes[0] / "steps").mkdir(exist_ok=True)
    shutil.copy(src / step_name(step), nodes[0] / step_name(step))
    for i, ref in enumerate(m.chunks):
        if i == drop:
            continue
        dst = nodes[i % 2] / chunk_path(ref.hash, ref.codec)
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(src / chunk_path(ref.hash, ref.codec), dst)


def peer_job(rank: int, world: int, base: str, fault: str = "") -> dict[str, Any]:
    import torch.distributed as dist

    tmp = Path(base)
    node = tmp / f"node{rank}"
    mem, disk = _store(node), CheckpointStore(LocalBackend(tmp / "root", fsync=False))
    journal = Journal(node / "journal.jsonl", rank=rank)
    state = _state(99)
    attempt = Attempt()

    def load(store: CheckpointStore, name: str) -> Any:
        return lambda s: load_step(
            state,
            s,
            store,
            tier_name=name,
            strict=True,
            rank=rank,
            readers=2,
            journal=journal,
            attempt=attempt,
        )

    group, broken = dist.group.WORLD, []
    if fault == "send":  # the holder fails mid-fetch; its partner's gloo recv times out
        group = dist.new_group(backend="gloo", timeout=timedelta(seconds=3))
        if rank == 0:
            import flashckpt.distributed.replication.peerfetch as peerfetch

            def reset(*a: Any, **k: Any) -> Any:
                raise RuntimeError("Connection reset by peer")

            peerfetch._post_send = reset  # type: ignore[assignment]
    if fault in ("stall-manifest", "stall-plan"):  # rank 1 stalls past the group's timeout
        import time

        import flashckpt.distributed.replication.peerrestore as peerrestore

        group = dist.new_group(backend="gloo", timeout=timedelta(seconds=3))
        name = "broadcast_bytes" if fault == "stall-manifest" else "plan_fetch"
        real = getattr(peerrestore, name)

        def stalled(*a: Any, **k: Any) -> Any:
            time.sleep(5.0)
            return real(*a, **k)

        if rank == 1:
            setattr(peerrestore, name, stalled)
    peer = PeerSource(
        store=mem,
        tier=tier_identity(node),
        leader=True,
        channel=lambda: nullcontext(group),
        load=load(mem, "memory"),
        journal=journal,
        broken=lambda exc: broken.append(type(exc).__name__),
    )
    if fault == "commit" and rank == 1:  # the replacement node's tier is full

        def full(*a: Any, **k: Any) -> None:
            raise StorageError("No space left on device")

        mem.commit = full  # type: ignore[method-assign]
    if fault == "load" and rank == 1:
        peer.load = lambda s: (_ for _ in ()).throw(CorruptCheckpointError("flipped bit"))
    ctx = DistContext.detect(root=str(tmp / "root"), timeout_s=30)
    assert ctx is not None
    got = restore_agreed(
        ctx,
        disk,
        step=None,
        steps=sorted({*mem.steps(), *disk.steps()}),
        load=load(disk, "local"),
        on_corrupt=lambda s, m: None,
        state=state,
        peer=peer,
    )
    events = [e for e in read_events(node / "journal.jsonl") if e["event"] != "restore"]
    loads = [e["tier"] for e in read_events(node / "journal.jsonl") if e["event"] == "restore"]
    return {
        "step": got,
        "state": state["model"],
        "events": events,
        "loads": loads,
        "broken": broken,
    }


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(a[k], b[k]) for k in a)


def test_restores_the_newest_step_from_the_node_tiers_without_the_disk(
    ranks: Any, tmp_path: Path
) -> None:
    _save(tmp_path / "src", 5, seed=5)
    _save(tmp_path / "root", 3, seed=3)  # an older step on disk
    nodes = [tmp_path / "node0", tmp_path / "node1"]
    _spread(tmp_path / "src", 5, nodes)
    res = ranks.ok(ranks(peer_job, 2, tmp_path, str(tmp_path)))
    for r in res:
        assert r["step"] == 5 and _same(r["state"], _state(5)["model"])
        assert r["loads"] == ["memory"], "loaded from its own node's tier only"
        (done,) = [e for e in r["events"] if e["event"] == "restored_from_peers"]
        assert done["step"] == 5 and done["bytes"] > 0
    assert (nodes[1] / step_name(5)).exists(), "the node without the manifest got it"
    (done,) = [e for e in res[0]["events"] if e["event"] == "restored_from_peers"]
    assert done["sources"] == {"1": done["bytes"]}


def test_a_chunk_no_node_holds_falls_back_to_the_disk_together(ranks: Any, tmp_path: Path) -> None:
    _save(tmp_path / "src", 5, seed=5)
    _save(tmp_path / "root", 3, seed=3)
    _spread(tmp_path / "src", 5, [tmp_path / "node0", tmp_path / "node1"], drop=2)
    res = ranks.ok(ranks(peer_job, 2, tmp_path, str(tmp_path)))
    for r in res:
        assert r["step"] == 3 and _same(r["state"], _state(3)["model"])
        assert r["loads"] == ["local"]
        assert not [e for e in r["events"] if e["event"] == "restored_from_peers"]


@pytest.mark.parametrize("fault", ["commit", "load", "send"])
def test_a_failure_on_one_rank_sends_every_rank_to_the_disk(
    ranks: Any, tmp_path: Path, fault: str
) -> None:
    _save(tmp_path / "src", 5, seed=5)
    _save(tmp_path / "root", 3, seed=3)
    _spread(tmp_path / "src", 5, [tmp_path / "node0", tmp_path / "node1"])
    res = ranks.ok(ranks(peer_job, 2, tmp_path, str(tmp_path), fault))
    for r in res:
        assert r["step"] == 3 and _same(r["state"], _state(3)["model"])
        (failed,) = [e for e in r["events"] if e["event"] == "peer_restore_failed"]
        failing = "rank 0: RuntimeError: Connection reset" if fault == "send" else "rank 1"
        assert failed["step"] == 5 and failing in failed["error"], failed
        assert failed["phase"] == ("loading" if fault == "load" else "fetching")
        assert r["loads"][-1] == "local"
        assert len(r["broken"]) == (fault == "send"), "only a transport error breaks the group"


def test_a_newer_step_on_disk_wins_over_older_node_tiers(ranks: Any, tmp_path: Path) -> None:
    _save(tmp_path / "src", 5, seed=5)
    _save(tmp_path / "root", 7, seed=7)
    _spread(tmp_path / "src", 5, [tmp_path / "node0", tmp_path / "node1"])
    res = ranks.ok(ranks(peer_job, 2, tmp_path, str(tmp_path)))
    for r in res:
        assert r["step"] == 7 and _same(r["state"], _state(7)["model"])


def test_peer_candidates_are_the_memory_steps_newer_than_any_slower_only_step() -> None:
    ready = [{"mem": [5, 6]}, {"mem": [4]}]
    values = [{"steps": [3, 4, 5, 6]}, {"steps": [2, 3, 4, 8]}]
    assert peer_candidates(None, ready, values) == []  # step 8 is on disk only
    values[1]["steps"] = [2, 3, 4]
    assert peer_candidates(None, ready, values) == [6, 5, 4]
    assert peer_candidates(5, ready, values) == [5]
    assert peer_candidates(3, ready, values) == []


def test_peer_candidates_are_no_older_than_the_newest_step_of_a_slower_tier() -> None:
    ready = [{"mem": [4, 5, 6], "slow": [3, 5]}, {"mem": [4, 5], "slow": None}]
    values = [{"steps": [3, 4, 5, 6]}, {"steps": [3, 4, 5]}]
    assert peer_candidates(None, ready, values) == [6, 5], "never 4: the disk holds 5"
    ready[0]["slow"] = [7]
    assert peer_candidates(None, ready, values) == []
    ready[0]["slow"] = []
    assert peer_candidates(None, ready, values) == [6, 5, 4]


@pytest.mark.parametrize("fault", ["stall-manifest", "stall-plan"])
def test_a_stall_while_sharing_the_manifest_or_planning_falls_back_to_the_disk_together(
    ranks: Any, tmp_path: Path, fault: str
) -> None:
    """Issue 27: a stall (or kill) while the ranks exchange the manifest or plan the peer fetch
    made restore() raise raw gloo errors; every rank now falls back to the disk tier together."""
    _save(tmp_path / "src", 5, seed=5)
    _save(tmp_path / "root", 3, seed=3)
    _spread(tmp_path / "src", 5, [tmp_path / "node0", tmp_path / "node1"])
    res = ranks.ok(ranks(peer_job, 2, tmp_path, str(tmp_path), fault))
    for r in res:
        assert r["step"] == 3 and _same(r["state"], _state(3)["model"])
        (failed,) = [e for e in r["events"] if e["event"] == "peer_restore_failed"]
        assert failed["step"] == 5 and failed["phase"] == "planning", failed
        assert r["loads"] == ["local"], "nothing was loaded from the node tiers"
        assert r["broken"], "the side group is given up (gloo groups do not recover)"


def test_a_node_tier_copy_of_an_abandoned_branch_is_never_a_peer_candidate() -> None:
    """Issue 27 (requeue onto the old node, replicas=1 path): run 1 saved 5 and 6 in the node
    tiers and died; run 2 restored 4 from disk and saved 5 there. Run 3 must not take run 1's
    6 (or 5) from the node tiers: the judge sees every node tier's copies and the disk's."""
    run1 = {"generation": 1, "parent_generation": None, "parent_step": None}
    run2 = {"generation": 2, "parent_generation": 1, "parent_step": 4}
    ready = [
        {
            "mem": [5, 6],
            "slow": [4, 5],
            "lin": [(5, run1), (6, run1)],
            "slow_lin": [(4, run1), (5, run2)],
        },
        {"mem": [6], "slow": None, "lin": [(6, run1)], "slow_lin": None},
    ]
    values = [{"steps": [4, 5, 6]}, {"steps": [6]}]
    assert peer_candidates(None, ready, values) == []
    assert peer_candidates(6, ready, values) == []
    ready[0]["slow_lin"] = [(4, run1), (5, run1)]  # no later run: run 1's copies are live
    assert peer_candidates(None, ready, values) == [6, 5]
    ready[0]["lin"] = [(5, "legacy"), (6, None)]  # older manifests, an unreadable one
    ready[1]["lin"] = [(6, None)]
    assert peer_candidates(None, ready, values) == [6], "5 on disk is a later run's"
    ready[0]["slow_lin"] = [(4, "legacy"), (5, "legacy")]
    assert peer_candidates(None, ready, values) == [6, 5]
