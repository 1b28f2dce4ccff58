"""The replication thread runs at a lower CPU priority than training (Linux per-thread nice).

Measured with benchmarks/replication_bench.py on an idle 2-core machine: with the thread at the
training threads' priority, steps taken while a round was in flight were 84-110% slower; at
nice 10, 13-15% (BENCHMARKS.md "Peer replication")."""

from __future__ import annotations

import os
import threading

import pytest

from flashckpt.dist import replicate
from flashckpt.dist.priority import BACKGROUND_NICE, background_priority

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
