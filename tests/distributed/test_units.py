"""The distributed building blocks without processes: owners, merge, the store barrier."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
from torch import nn
from torch.distributed import HashStore

from flashckpt.distributed.group.barrier import StoreBarrier, raise_failed
from flashckpt.distributed.group.context import store_name
from flashckpt.distributed.merge import merge_parts
from flashckpt.distributed.ownership import assign_owners, rename_refs, split_for_rank
from flashckpt.errors import DistributedError
from flashckpt.state.capture import capture
from flashckpt.state.rng import RNG
from flashckpt.store.format.manifest import ChunkRef, Extent, Manifest, Shard, TensorEntry


def test_owners_balance_bytes_and_are_deterministic() -> None:
    sizes = {f"k{i}": s for i, s in enumerate([100, 90, 80, 70, 60, 50, 40, 30, 20, 10])}
    owners = assign_owners(sizes, 3)
    assert owners == assign_owners(dict(reversed(list(sizes.items()))), 3)  # order-free
    loads = [sum(sizes[k] for k, r in owners.items() if r == rank) for rank in range(3)]
    assert max(loads) - min(loads) <= 10, loads
    assert set(owners.values()) == {0, 1, 2}


def test_split_keeps_owned_and_renames_per_rank_state() -> None:
    state = {"model": nn.Linear(8, 8), "rng": RNG(python=False, numpy=False), "data": {"pos": 3}}
    kept = {}
    for rank in range(2):
        cap = capture(state)
        per_rank = split_for_rank(cap, state, rank=rank, world_size=2)
        assert sorted(per_rank) == ["data", "rng"]
        kept[rank] = {i.key for i in cap.items}
        assert cap.tree["rng"]["torch"] == {"__t__": f"rng/torch@rank{rank}"}
    model_keys = {"model/weight", "model/bias"}
    assert (kept[0] | kept[1]) & model_keys == model_keys
    assert not (kept[0] & kept[1] & model_keys)  # each replicated tensor written once


def test_rename_refs_walks_nested_trees() -> None:
    tree = {"a": [{"__t__": "x"}, {"__tuple__": [{"__np__": "y"}]}], "b": {"__t__": "z"}}
    out = rename_refs(tree, {"x": "x@rank1", "y": "y@rank1"})
    assert out == {
        "a": [{"__t__": "x@rank1"}, {"__tuple__": [{"__np__": "y@rank1"}]}],
        "b": {"__t__": "z"},
    }


def _part(rank: int, rows: tuple[int, int], h: str) -> Manifest:
    n = rows[1] - rows[0]
    shard = Shard(
        offset=(rows[0], 0), shape=(n, 2), extents=(Extent(chunk=0, offset=0, length=n * 8),)
    )
    entry = TensorEntry(
        key="w", kind="torch", dtype="float32", global_shape=(4, 2), shards=(shard,)
    )
    return Manifest(
        step=5,
        time_s=1.0,
        tree={"model": {"w": {"__t__": "w"}}},
        rank_trees={str(rank): {"data": rank}},
        tensors={"w": entry},
        chunks=[ChunkRef(hash=h * 32, size=n * 8)],
        stats={"total_bytes": n * 8},
    )


def test_merge_unites_shards_and_remaps_chunks() -> None:
    m = merge_parts([_part(0, (0, 1), "a"), _part(1, (1, 4), "b")], step=5)
    assert m.world_size == 2
    shards = m.tensors["w"].shards
    assert [(s.rank, s.offset, m.chunks[s.extents[0].chunk].hash[0]) for s in shards] == [
        (0, (0, 0), "a"),
        (1, (1, 0), "b"),
    ]
    assert m.rank_trees == {"0": {"data": 0}, "1": {"data": 1}}
    assert m.stats["total_bytes"] == 32


def test_merge_refuses_a_hole() -> None:
    with pytest.raises(DistributedError, match="6 of 8 elements") as info:
        merge_parts([_part(0, (0, 1), "a"), _part(1, (1, 3), "b")], step=5)
    assert info.value.phase == "publish"


def _run_ranks(world: int, fn: Any) -> list[Any]:
    out: list[Any] = [None] * world

    def run(rank: int) -> None:
        try:
            out[rank] = fn(rank)
        except DistributedError as exc:
            out[rank] = exc

    threads = [threading.Thread(target=run, args=(r,), name=f"rank-{r}") for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return out


def _barrier(store: Any, rank: int, world: int, timeout_s: float = 5.0) -> StoreBarrier:
    return StoreBarrier(store=store, rank=rank, world_size=world, timeout_s=timeout_s, prefix="t")


def test_barrier_carries_errors_identically() -> None:
    store = HashStore()

    def fn(rank: int) -> None:
        b = _barrier(store, rank, 3)
        b.agree("one", None)
        b.agree("two", "disk full" if rank == 2 else None, step=7)

    out = _run_ranks(3, fn)
    assert all(isinstance(e, DistributedError) for e in out), out
    assert len({str(e) for e in out}) == 1
    assert (out[0].phase, out[0].ranks) == ("two", [2])
    assert "rank 2: disk full" in str(out[0]) and "step 7" in str(out[0])


def test_barrier_times_out_naming_missing_rank() -> None:
    store = HashStore()

    def fn(rank: int) -> None:
        if rank == 1:
            return  # never arrives
        _barrier(store, rank, 3, timeout_s=0.5).agree("save", None)

    t0 = time.monotonic()
    out = _run_ranks(3, fn)
    assert time.monotonic() - t0 < 5
    for rank in (0, 2):
        assert isinstance(out[rank], DistributedError)
        assert out[rank].ranks == [1] and "timeout" in str(out[rank])


def test_barrier_deletes_its_previous_keys() -> None:
    store = HashStore()

    def fn(rank: int) -> None:
        b = _barrier(store, rank, 2)
        b.agree("one", None)
        b.agree("two", None)

    assert _run_ranks(2, fn) == [None, None]
    assert not any(store.check([f"t/one/{k}"]) for k in ("v0", "v1", "n", "full", "result"))
    assert store.check(["t/two/v0"]) and store.check(["t/two/result"])


def test_value_exchange_returns_rank_order() -> None:
    store = HashStore()
    out = _run_ranks(3, lambda r: _barrier(store, r, 3).exchange("x", {"r": r * 10}))
    assert out == [[{"r": 0}, {"r": 10}, {"r": 20}]] * 3


def test_merge_refuses_overlapping_shards() -> None:
    """Rows 0-1 and 1-3 of a 4-row tensor: the volumes add up (2 + 2 = 4), the tensor is not
    covered (row 3 missing, row 1 twice). Only the sum was compared before."""
    with pytest.raises(DistributedError, match="overlap") as info:
        merge_parts([_part(0, (0, 2), "a"), _part(1, (1, 3), "b")], step=5)
    assert info.value.phase == "publish" and info.value.ranks == [0, 1]


def test_merge_refuses_a_shard_outside_the_tensor() -> None:
    with pytest.raises(DistributedError, match="outside"):
        merge_parts([_part(0, (0, 2), "a"), _part(1, (3, 5), "b")], step=5)


class CountingStore:
    """A Store proxy counting the requests each thread (rank) makes."""

    def __init__(self, store: Any) -> None:
        self.store = store
        self.counts: dict[str, int] = {}
        self.lock = threading.Lock()

    def __getattr__(self, name: str) -> Any:
        fn = getattr(self.store, name)

        def call(*args: Any) -> Any:
            who = threading.current_thread().name
            with self.lock:
                self.counts[who] = self.counts.get(who, 0) + 1
            return fn(*args)

        return call


def test_barrier_requests_per_rank_do_not_grow_with_the_world() -> None:
    """Every waiting rank polled every missing rank before (O(world^2) per phase)."""
    per_rank = {}
    for world in (4, 32):
        store = CountingStore(HashStore())
        barriers = [_barrier(store, r, world) for r in range(world)]

        def fn(rank: int, barriers: list[StoreBarrier] = barriers) -> None:
            time.sleep(0.01 * (rank % 4))  # arrivals spread out: waiters would poll
            barriers[rank].agree("one", None)

        assert _run_ranks(world, fn) == [None] * world
        followers = [n for who, n in store.counts.items() if who != "rank-0"]
        per_rank[world] = max(followers)
        assert store.counts["rank-0"] <= world + 12, store.counts["rank-0"]  # deletes included
    assert per_rank[32] == per_rank[4] <= 6, per_rank


def test_barrier_late_rank_raises_the_decided_timeout() -> None:
    store = HashStore()
    started = time.monotonic()

    def fn(rank: int) -> None:
        if rank == 2:
            time.sleep(1.2)  # arrives after the others gave up: it must not proceed alone
        _barrier(store, rank, 3, timeout_s=0.5).agree("save", None)

    out = _run_ranks(3, fn)
    assert all(isinstance(e, DistributedError) for e in out), out
    assert len({str(e) for e in out}) == 1 and out[0].ranks == [2]
    assert time.monotonic() - started < 10


def test_barrier_leader_missing_is_named_by_every_rank() -> None:
    store = HashStore()

    def fn(rank: int) -> None:
        if rank == 0:
            return  # the leader never arrives
        _barrier(store, rank, 3, timeout_s=0.3).agree("save", None)

    out = _run_ranks(3, fn)
    assert out[0] is None
    assert isinstance(out[1], DistributedError) and str(out[1]) == str(out[2])
    assert out[1].ranks == [0] and "never arrived" in str(out[1])


def test_barrier_decision_is_the_leaders_on_every_rank() -> None:
    store = HashStore()

    def fn(rank: int) -> Any:
        b = _barrier(store, rank, 3)
        return b.decide("plan", {"n": rank}, lambda vals: sum(v["n"] for v in vals) * 10)[1]

    assert _run_ranks(3, fn) == [30, 30, 30]


def test_barrier_failing_decision_fails_the_phase_everywhere() -> None:
    store = HashStore()

    def boom(values: list[dict[str, Any]]) -> Any:
        raise OSError("no space to decide")

    def fn(rank: int) -> None:
        b = _barrier(store, rank, 2)
        values, _ = b.decide("plan", {"ok": True}, boom)
        raise_failed(values, phase="plan", step=3)

    out = _run_ranks(2, fn)
    assert all(isinstance(e, DistributedError) for e in out)
    assert (
        out[0].ranks == [0] and "no space to decide" in str(out[0]) and str(out[0]) == str(out[1])
    )


def test_store_names_come_from_the_root() -> None:
    a, b = store_name("world", "/x/a"), store_name("world", "/x/b")
    assert a != b and a == store_name("world", "/x/a")
    assert store_name("world", "/x/a", "run1") == store_name("world", "/x/b", "run1")
    assert store_name("g1", "/x/a") != a
