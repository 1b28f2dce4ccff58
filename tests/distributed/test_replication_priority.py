"""The replication thread runs at a lower CPU priority than training (Linux per-thread nice).

Measured with benchmarks/replication_bench.py on an idle 2-core machine: with the thread at the
training threads' priority, steps taken while a round was in flight were 84-110% slower; at
nice 10, 13-15% (BENCHMARKS.md "Peer replication")."""

from __future__ import annotations

import os
import threading

import pytest

from flashckpt.distributed.group.priority import (
    BACKGROUND_NICE,
    background_priority,
    with_background_priority,
)
from flashckpt.distributed.replication import replicate

linux_only = pytest.mark.skipif(
    not hasattr(os, "setpriority") or not hasattr(threading, "get_native_id"),
    reason="per-thread priorities are a Linux feature",
)


def _priority_in_thread(fn) -> tuple[int, int]:
    out: list[int] = []

    def body() -> None:
        tid = threading.get_native_id()
        fn()
        out.append(os.getpriority(os.PRIO_PROCESS, tid))

    t = threading.Thread(target=body)
    t.start()
    t.join()
    return out[0], os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


@linux_only
def test_background_priority_lowers_only_the_calling_thread() -> None:
    before = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    inside, caller = _priority_in_thread(background_priority)
    assert inside >= BACKGROUND_NICE
    assert caller == before  # the training thread keeps its priority


@linux_only
def test_the_replication_thread_lowers_its_priority_first(monkeypatch) -> None:
    seen: list[int] = []

    class Stop(Exception):
        pass

    def fake_priority() -> None:
        seen.append(threading.get_native_id())
        raise Stop

    monkeypatch.setattr(replicate, "background_priority", fake_priority)  # as imported there
    r = object.__new__(replicate.Replicator)  # only _run's first statement is under test
    with pytest.raises(Stop):
        r._run()
    assert seen == [threading.get_native_id()]


def _task_nices() -> dict[int, int]:
    """nice value of every thread of this process, by native thread id (/proc)."""
    out: dict[int, int] = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            out[int(tid)] = os.getpriority(os.PRIO_PROCESS, int(tid))
        except OSError:  # the thread ended meanwhile
            pass
    return out


@linux_only
def test_with_background_priority_runs_at_low_priority_and_threads_inherit_it() -> None:
    before = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    def body() -> tuple[int, int]:
        child: list[int] = []
        t = threading.Thread(
            target=lambda: child.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
        )
        t.start()
        t.join()
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id()), child[0]

    inside, child = with_background_priority(body)
    assert inside >= BACKGROUND_NICE and child >= BACKGROUND_NICE
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == before

    class Boom(Exception):
        pass

    def fails() -> None:
        raise Boom("raised on the helper thread")

    with pytest.raises(Boom, match="helper thread"):
        with_background_priority(fails)


@linux_only
def test_a_side_group_created_at_background_priority_runs_gloo_threads_at_it(tmp_path) -> None:
    """Regression: only the replication thread was at nice 10; the gloo group's own worker and
    transport threads, which copy and move every replicated byte, ran at the training threads'
    priority (they inherit the nice value of the thread that created the group)."""
    import torch.distributed as dist

    from flashckpt.distributed.runtime import _side_group

    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group(
            "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
        )
    try:
        old = set(_task_nices())
        group = with_background_priority(lambda: _side_group(None, 30.0))
        new = {tid: n for tid, n in _task_nices().items() if tid not in old}
        assert new, "creating a gloo group started no thread (torch changed?)"
        assert all(n >= BACKGROUND_NICE for n in new.values()), new
        dist.destroy_process_group(group)
    finally:
        if owned:
            dist.destroy_process_group()


def low_priority_threads(rank: int, world: int, node: int, mem: str) -> dict[str, int]:
    """Threads at background priority before and after opening a replicating Checkpointer."""
    from flashckpt import Checkpointer
    from flashckpt.engine.options import Replication

    low = lambda: sum(1 for n in _task_nices().values() if n >= BACKGROUND_NICE)  # noqa: E731
    before = low()
    with Checkpointer(
        f"{mem}/root", memory_tier=f"{mem}/n{node}", replicas=Replication(timeout_s=30)
    ) as ck:
        assert ck._dist.side_group is not None
        after = low()
    return {"before": before, "after": after}


@pytest.mark.slow
@linux_only
def test_replicating_ranks_run_the_side_groups_gloo_threads_at_background_priority(
    tmp_path,
) -> None:
    """Regression (through the public API, two simulated nodes): the replication thread was
    the only thread at background priority; now the side group's gloo threads are too (at
    least its two worker threads)."""
    from multinode import Cluster

    cluster = Cluster(tmp_path, nodes=2, per_node=1)
    res = cluster.run("test_replication_priority:low_priority_threads", mem=str(tmp_path))
    for rank, r in res.items():
        assert r["before"] == 0, (rank, r)
        assert r["after"] >= 1 + 2, (rank, r)  # the replication thread + gloo's 2 workers
