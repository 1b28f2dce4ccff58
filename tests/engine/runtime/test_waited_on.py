"""Every wait for a save raises its threads (the class behind three priority inversions).

The governor runs a save's threads at SCHED_BATCH (nice 10 where it can be undone) beside
training. Whoever then waits for them must not wait for threads that busy processes starve, so
each wait runs them at SCHED_OTHER, nice 0, for as long as it lasts. The waits used to raise them
one call site at a time (the optimizer hook, save(), wait(), close()), and the ones left out kept
waiting at the background level: ``save()`` of a state without an optimizer waiting for its own
staging, the caller's ``handle.wait()``, ``handle.staged.result()`` or ``.exception()``, and the
exit handler finishing the save in flight. Now the handle's futures are the one gateway
(engine/save/handle.py, ``Outcome.waited_on``), and these tests wait through each door.
"""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch
from test_priority import _thread

import flashckpt
from flashckpt.engine.runtime.priority import ThreadPriority

pytestmark = pytest.mark.skipif(not hasattr(os, "SCHED_BATCH"), reason="Linux scheduling only")


def _held_until_raised(seen: list[int]):
    """A wrapper that holds its call until its own thread runs at SCHED_OTHER (up to 10 s),
    then records the policy it got: only a wait raises it."""

    def wrap(real):
        def held(*args, **kwargs):
            give_up = time.monotonic() + 10
            while os.sched_getscheduler(0) != os.SCHED_OTHER and time.monotonic() < give_up:
                time.sleep(0.005)
            seen.append(os.sched_getscheduler(0))
            return real(*args, **kwargs)

        return held

    return wrap


def _state() -> dict:
    return {"m": {f"w{i}": torch.randn(1000) for i in range(4)}}


@pytest.mark.parametrize(
    "waiter",
    ["handle.wait", "durable.result", "durable.exception", "exit handler", "another thread"],
)
def test_every_wait_for_a_durable_save_runs_its_threads_at_full_speed(
    tmp_path, monkeypatch, waiter
) -> None:
    from flashckpt.engine.runtime.exit import finish_in_flight
    from flashckpt.store.files.backend import LocalBackend

    seen: list[int] = []
    real_put = LocalBackend.put

    def put(backend, path, parts):  # only the chunk writes are held
        if not path.startswith("chunks/"):
            return real_put(backend, path, parts)
        return _held_until_raised(seen)(real_put)(backend, path, parts)

    monkeypatch.setattr(LocalBackend, "put", put)
    ck = flashckpt.Checkpointer(tmp_path, async_save=True, chunk_size="8KiB", fsync=False)
    try:
        handle = ck.save(1, _state())
        assert ck._saver.priority.level == "background"  # the governor's background save
        if waiter == "handle.wait":
            handle.wait()
        elif waiter == "durable.result":
            handle.durable.result()
        elif waiter == "durable.exception":
            assert handle.durable.exception() is None
        elif waiter == "exit handler":
            assert finish_in_flight(ck._saver.inflight, ck.journal, 60)
        else:  # a thread of the caller's own (a metrics or upload thread)
            t = threading.Thread(target=handle.wait)
            t.start()
            t.join(60)
        assert handle.durable.done()
        assert seen and set(seen) == {os.SCHED_OTHER}, seen
        assert {os.sched_getscheduler(t) for t in ck._saver.priority.threads} == {
            os.SCHED_BATCH
        }  # and back once the wait ended
    finally:
        ck.close()
    assert os.sched_getscheduler(0) == os.SCHED_OTHER  # the caller's thread never changes


@pytest.mark.parametrize("waiter", ["save without an optimizer", "staged.result"])
def test_every_wait_for_staging_runs_the_stager_at_full_speed(
    tmp_path, monkeypatch, waiter
) -> None:
    """``save()`` of a state with no optimizer to overlap waits for its own staging; so does a
    caller's ``handle.staged.result()``: the staging (on the stager thread) is held until that
    thread runs at SCHED_OTHER, which happens only once something waits for it."""
    from flashckpt.engine.save import job as job_mod

    seen: list[int] = []
    monkeypatch.setattr(job_mod.SaveJob, "run", _held_until_raised(seen)(job_mod.SaveJob.run))
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(4, 64)).sum().backward()
    opt.step()
    with flashckpt.Checkpointer(tmp_path, async_save=True, fsync=False) as ck:
        if waiter == "save without an optimizer":
            handle = ck.save(1, _state())  # returns once staged
        else:
            handle = ck.save(1, {"model": model, "opt": opt})  # returns before staging ends
            assert not handle.staged.done()
            handle.staged.result()
        assert handle.staged.done()
        assert seen == [os.SCHED_OTHER], seen
        assert ck._saver.priority.level == "background"
        handle.wait()


def test_overlapping_waits_keep_the_threads_raised_until_the_last_one_ends() -> None:
    """Two waits at once (the loop and a thread of the caller's): the first to end must not
    lower the threads the other still waits for; a level the governor sets meanwhile takes
    effect once no one waits; a thread that starts during a wait starts raised."""
    p = ThreadPriority(use_nice=False)
    tid, done, t = _thread(p)
    try:
        assert os.sched_getscheduler(tid) == os.SCHED_BATCH
        first, second = p.waited_on(), p.waited_on()
        first.__enter__()
        second.__enter__()
        late, late_done, late_t = _thread(p)
        assert os.sched_getscheduler(late) == os.SCHED_OTHER  # started during the waits
        first.__exit__(None, None, None)
        assert os.sched_getscheduler(tid) == os.SCHED_OTHER  # the second wait still runs
        p.set("background")  # the governor, meanwhile (a save starting in another thread)
        assert os.sched_getscheduler(tid) == os.SCHED_OTHER
        second.__exit__(None, None, None)
        assert {os.sched_getscheduler(x) for x in (tid, late)} == {os.SCHED_BATCH}
        with p.waited_on():
            p.set("foreground")  # a foreground save while waited on: stays up after
        assert {os.sched_getscheduler(x) for x in (tid, late)} == {os.SCHED_OTHER}
        late_done.set()
        late_t.join()
    finally:
        done.set()
        t.join()
