"""The background threads' CPU level (engine/runtime/priority.py): SCHED_BATCH (and nice 10
where it can be undone) while a save runs beside training, normal while the loop waits."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch

import flashckpt
from flashckpt.engine.runtime import priority as prio
from flashckpt.engine.runtime.governor import FOREGROUND
from flashckpt.engine.runtime.priority import BACKGROUND_NICE, ThreadPriority

pytestmark = pytest.mark.skipif(not hasattr(os, "SCHED_BATCH"), reason="Linux scheduling only")


def _thread(p: ThreadPriority, *, background_only: bool = False):
    ready, done = threading.Event(), threading.Event()
    box: dict = {}

    def run() -> None:
        p.register_background() if background_only else p.register()
        box["tid"] = threading.get_native_id()
        ready.set()
        done.wait(30)

    t = threading.Thread(target=run)
    t.start()
    ready.wait(10)
    return box["tid"], done, t


def _level(tid: int) -> tuple[int, int]:
    return os.sched_getscheduler(tid), os.getpriority(os.PRIO_PROCESS, tid)


@pytest.mark.parametrize("use_nice", [True, False])
def test_threads_move_between_the_levels_and_back(use_nice: bool) -> None:
    if use_nice and not prio.may_raise_priority():
        pytest.skip("this process may not lower a nice value again")
    p = ThreadPriority(use_nice=use_nice)
    tid, done, t = _thread(p)
    try:
        nice = BACKGROUND_NICE if use_nice else 0
        assert _level(tid) == (os.SCHED_BATCH, nice)  # registered at the background level
        p.set("foreground")
        assert _level(tid) == (os.SCHED_OTHER, 0)
        p.set("background")
        assert _level(tid) == (os.SCHED_BATCH, nice)
        assert p.threads == [tid]
        assert p.describe() == ("SCHED_BATCH, nice 10" if use_nice else "SCHED_BATCH")
    finally:
        done.set()
        t.join()
    p.set("foreground")  # the thread is gone: dropped, no error
    assert p.threads == []
    assert _level(threading.get_native_id()) == (os.SCHED_OTHER, 0)  # the caller untouched


def test_a_thread_id_reused_after_its_thread_ended_is_never_touched() -> None:
    """Regression: the kernel reuses the id of a thread that ended; a level change then moved
    whatever thread had the id now (found when this file ran beside others: an id registered
    by an ended thread was alive again)."""
    p = ThreadPriority(use_nice=False)
    _tid, done, t = _thread(p)
    done.set()
    t.join()
    me = threading.get_native_id()
    p._tids[me] = t  # the ended thread's entry, now under an id a live thread (this one) has
    p.set("foreground")
    p.set("background")
    assert _level(me) == (os.SCHED_OTHER, 0) and p.threads == []


PROBE = """
import json, os, threading
from flashckpt.engine.runtime import priority as prio
from flashckpt.engine.runtime.priority import ThreadPriority
p = ThreadPriority()
done = threading.Event()
t = threading.Thread(target=lambda: (p.register(), done.wait()))
t.start()
while not p.threads:
    pass
tid = p.threads[0]
background = [os.sched_getscheduler(tid), os.getpriority(os.PRIO_PROCESS, tid)]
p.set("foreground")
foreground = [os.sched_getscheduler(tid), os.getpriority(os.PRIO_PROCESS, tid)]
done.set()
t.join()
try:
    from flashckpt.engine.cpupolicy import lowest_undoable_policy
    low = lowest_undoable_policy()
except ImportError:  # (the code before the fix)
    low = None
print(json.dumps({"may": prio.may_raise_priority(), "low": low,
                  "background": background, "foreground": foreground}))
"""


def test_a_process_that_may_not_raise_priority_again_never_lowers_it_for_good(
    python_without_sys_nice: Callable[[str], Any],
) -> None:
    """Regression: whether this process may raise a priority again was read from its effective
    uid, so a root without ``CAP_SYS_NICE`` moved its save threads to nice 10 and could not
    bring them back while the loop waited. Probed in a real process that may not: its threads
    get ``SCHED_BATCH`` alone and come back to normal, and a standby would start under
    ``SCHED_BATCH``, not ``SCHED_IDLE`` (tests/distributed/standby/test_wait.py)."""
    got = python_without_sys_nice(PROBE)
    assert got["background"] == [os.SCHED_BATCH, 0] and got["foreground"] == [os.SCHED_OTHER, 0]
    assert got["may"] is False and got["low"] == os.SCHED_BATCH


def test_a_refused_change_turns_the_levels_off_without_an_error(monkeypatch) -> None:
    def refuse(*_a):
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "sched_setscheduler", refuse)
    p = ThreadPriority(use_nice=False)
    _tid, done, t = _thread(p)
    try:
        p.set("foreground")
        assert p.describe() == "unmanaged"
    finally:
        done.set()
        t.join()


def test_async_saves_run_their_threads_in_the_background_and_foreground_saves_at_full_speed(
    tmp_path,
) -> None:
    state = {"m": {f"w{i}": torch.randn(1000) for i in range(8)}}
    with flashckpt.Checkpointer(tmp_path, async_save=True, chunk_size="8KiB") as ck:
        saver = ck._saver
        ck.save(1, state).wait()
        tids = saver.priority.threads
        assert tids  # the stager and the persist workers registered
        assert {os.sched_getscheduler(t) for t in tids} == {os.SCHED_BATCH}
        saver.governor.mode = FOREGROUND  # what the governor decides when it measured so
        ck.save(2, state).wait()
        assert {os.sched_getscheduler(t) for t in saver.priority.threads} == {os.SCHED_OTHER}
    assert os.sched_getscheduler(0) == os.SCHED_OTHER  # the training thread never changes


def test_synchronous_saves_leave_their_threads_alone(tmp_path) -> None:
    with flashckpt.Checkpointer(tmp_path) as ck:
        ck.save(1, {"w": torch.randn(100)})
        assert ck._saver.priority.threads == []


def test_a_background_only_thread_stays_in_the_background() -> None:
    p = ThreadPriority(use_nice=False)
    tid, done, t = _thread(p, background_only=True)
    try:
        assert os.sched_getscheduler(tid) == os.SCHED_BATCH
        p.set("foreground")  # a foreground save: its own threads move, this one does not
        assert os.sched_getscheduler(tid) == os.SCHED_BATCH
        assert p.background_threads == [tid] and p.threads == []
    finally:
        done.set()
        t.join()
    p.set("background")
    assert p.background_threads == [] and not p._always  # forgotten once it ended


def _promotion_levels(ck: flashckpt.Checkpointer) -> list[tuple[str, int]]:
    """Record the CPU policy each promotion copy thread runs its copies at."""
    seen: list[tuple[str, int]] = []
    copier = ck._tiers.promoter._copier
    hook = copier.thread_start
    assert hook is not None  # the Checkpointer set it

    def recording() -> None:
        hook()
        seen.append((threading.current_thread().name, os.sched_getscheduler(0)))

    copier.thread_start = recording
    return seen


@pytest.mark.parametrize("async_save", [True, False])
def test_promotion_runs_in_the_background_whatever_the_saves_do(tmp_path, async_save) -> None:
    """Regression: the promotion thread and its copy threads ran at SCHED_OTHER, nice 0, beside
    training (with a memory tier the promotion after each save then cost a one-thread loop
    about as much again as the save); a foreground save must not move them either."""
    state = {"m": {f"w{i}": torch.randn(1000) for i in range(8)}}
    kw = {"async_save": async_save, "chunk_size": "8KiB"}
    with flashckpt.Checkpointer(tmp_path / "root", memory_tier=tmp_path / "mem", **kw) as ck:
        seen = _promotion_levels(ck)
        if async_save:
            ck._saver.governor.mode = FOREGROUND
        ck.save(1, state).wait()
        # not wait_promoted(): a promotion waited on runs at full speed meanwhile (below)
        give_up = time.monotonic() + 30
        while not (tmp_path / "root" / "steps" / "000000000001.json").exists():
            assert time.monotonic() < give_up, "the promotion did not finish"
            time.sleep(0.01)
        assert seen and {policy for _, policy in seen} == {os.SCHED_BATCH}, seen
        promote = [t for t in threading.enumerate() if t.name == "flashckpt-promote"]
        assert promote and os.sched_getscheduler(promote[0].native_id) == os.SCHED_BATCH
    assert os.sched_getscheduler(0) == os.SCHED_OTHER  # the training thread never changes


class _PolicyWhileWaited:
    """Chunk writes (on the persist threads) wait up to 10 s for their own thread to be moved
    to SCHED_OTHER, then record the policy they got: the loop is waiting for them by then."""

    def __init__(self) -> None:
        self.seen: list[int] = []

    def __call__(self, real):
        def put(backend, path, parts):
            if path.startswith("chunks/"):
                give_up = time.monotonic() + 10
                while os.sched_getscheduler(0) != os.SCHED_OTHER and time.monotonic() < give_up:
                    time.sleep(0.005)
                self.seen.append(os.sched_getscheduler(0))
            return real(backend, path, parts)

        return put


@pytest.mark.parametrize("waiter", ["wait", "next_save", "close"])
def test_threads_the_loop_waits_for_run_at_full_speed_meanwhile(
    tmp_path, monkeypatch, waiter
) -> None:
    """Regression (a priority inversion): the governor runs a save's threads at SCHED_BATCH,
    nice 10, so they take little from training beside them; when the loop then waited for them
    (a save or close() waiting for the save in flight, wait(), the optimizer hook waiting for
    staging) they stayed there, and busy processes took nine tenths of each core from the
    threads the loop stood waiting for. Now they run at SCHED_OTHER, nice 0, while it waits,
    and go back after."""
    from flashckpt.store.files.backend import LocalBackend

    recorder = _PolicyWhileWaited()
    monkeypatch.setattr(LocalBackend, "put", recorder(LocalBackend.put))
    state = {"m": {f"w{i}": torch.randn(1000) for i in range(4)}}
    ck = flashckpt.Checkpointer(tmp_path, async_save=True, chunk_size="8KiB", fsync=False)
    try:
        saver = ck._saver
        handle = ck.save(1, state)
        assert saver.priority.level == "background"  # the governor's first background save
        if waiter == "wait":
            ck.wait()
        elif waiter == "next_save":
            ck.save(2, state).wait()
        else:
            ck.close()
        assert handle.durable.done()
        assert recorder.seen and set(recorder.seen[:4]) == {os.SCHED_OTHER}, recorder.seen
        if waiter != "close":
            assert saver.priority.level == "background"  # and back after the wait
            assert {os.sched_getscheduler(t) for t in saver.priority.threads} == {os.SCHED_BATCH}
    finally:
        ck.close()
    assert os.sched_getscheduler(0) == os.SCHED_OTHER  # the training thread never changes


def test_the_optimizer_hook_waits_for_staging_at_full_speed(tmp_path, monkeypatch) -> None:
    """The same for the optimizer pre-step hook: staging (on the stager thread) is held until
    its thread runs at SCHED_OTHER, which happens only once the hook waits for it."""
    from flashckpt.engine.save import job as job_mod

    seen: list[int] = []
    real_stage = job_mod.SaveJob.run

    def run(self):
        give_up = time.monotonic() + 10
        while os.sched_getscheduler(0) != os.SCHED_OTHER and time.monotonic() < give_up:
            time.sleep(0.005)
        seen.append(os.sched_getscheduler(0))
        return real_stage(self)

    monkeypatch.setattr(job_mod.SaveJob, "run", run)
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(4, 64)).sum().backward()
    opt.step()
    with flashckpt.Checkpointer(tmp_path, async_save=True, fsync=False) as ck:
        handle = ck.save(1, {"model": model, "opt": opt})
        assert not handle.staged.done() and ck._saver.priority.level == "background"
        model(torch.randn(4, 64)).sum().backward()
        opt.step()  # the pre-step hook waits for staging
        assert handle.staged.done()
        assert seen == [os.SCHED_OTHER], seen
        assert ck._saver.priority.level == "background"


def test_background_only_threads_run_at_full_speed_while_waited_on() -> None:
    p = ThreadPriority(use_nice=False)
    tid, done, t = _thread(p, background_only=True)
    try:
        with p.background_waited_on():
            assert os.sched_getscheduler(tid) == os.SCHED_OTHER
            with p.background_waited_on():  # overlapping waits: the last one out moves back
                late, late_done, late_t = _thread(p, background_only=True)
                assert os.sched_getscheduler(late) == os.SCHED_OTHER  # started while waited on
            assert {os.sched_getscheduler(x) for x in (tid, late)} == {os.SCHED_OTHER}
        assert {os.sched_getscheduler(x) for x in (tid, late)} == {os.SCHED_BATCH}
        p.set("foreground")  # the save's level never moves them
        assert os.sched_getscheduler(tid) == os.SCHED_BATCH
    finally:
        done.set()
        late_done.set()
        t.join()
        late_t.join()


class _PromotionWaitedOn(_PolicyWhileWaited):
    def __call__(self, real):
        inner = super().__call__(real)

        def put(backend, path, parts):
            if threading.current_thread().name.startswith("flashckpt-copy"):
                return inner(backend, path, parts)
            return real(backend, path, parts)

        return put


def test_promotion_runs_at_full_speed_while_waited_on(tmp_path, monkeypatch) -> None:
    """Regression (the same inversion, one level down): the promotion threads run at the
    background level for good, and wait_promoted(), close() and a save waiting for room in a
    full promotion queue (``on_full="wait"``, the default) waited for them there. Now they run
    at SCHED_OTHER while waited on (each copy of a chunk to disk is held here until its thread
    does), and go back after."""
    from flashckpt.store.files.backend import LocalBackend

    recorder = _PromotionWaitedOn()
    monkeypatch.setattr(LocalBackend, "put", recorder(LocalBackend.put))
    state = {"m": {f"w{i}": torch.randn(1000) for i in range(4)}}
    with flashckpt.Checkpointer(
        tmp_path / "root",
        memory_tier=tmp_path / "mem",
        async_save=True,
        chunk_size="8KiB",
        fsync=False,
    ) as ck:
        ck.save(1, state).wait()
        assert ck.wait_promoted()
        assert recorder.seen and set(recorder.seen) == {os.SCHED_OTHER}, recorder.seen
        promote = [t for t in threading.enumerate() if t.name == "flashckpt-promote"]
        assert promote and os.sched_getscheduler(promote[0].native_id) == os.SCHED_BATCH


def test_wait_runs_the_staging_threads_queue_at_full_speed(tmp_path) -> None:
    """wait() also waits for what the staging thread has queued (a durable callback: its
    promotion, retention and gc): that thread runs at SCHED_OTHER meanwhile. Here nothing is
    in flight, so only that wait can raise it."""
    with flashckpt.Checkpointer(tmp_path, async_save=True, fsync=False) as ck:
        ck.save(1, {"w": torch.randn(1000)}).wait()
        assert ck._saver.priority.level == "background"
        seen: list[int] = []

        def queued() -> None:
            give_up = time.monotonic() + 10
            while os.sched_getscheduler(0) != os.SCHED_OTHER and time.monotonic() < give_up:
                time.sleep(0.005)
            seen.append(os.sched_getscheduler(0))

        ck._saver.stager.submit(queued)
        ck.wait()
        assert seen == [os.SCHED_OTHER]
        assert ck._saver.priority.level == "background"


def test_a_save_waiting_for_room_in_the_promotion_queue_raises_the_promotion(
    tmp_path, monkeypatch
) -> None:
    """``Promotion(on_full="wait")``: the durable callback of save 3 waits for room while step 1
    is copied and step 2 is queued; the copies (held until their thread runs at SCHED_OTHER)
    go on only because that wait raised them. No drain, no wait_promoted() here."""
    from flashckpt.engine.tiers.promote import Promotion
    from flashckpt.store.files.backend import LocalBackend

    recorder = _PromotionWaitedOn()
    monkeypatch.setattr(LocalBackend, "put", recorder(LocalBackend.put))
    state = {"m": {f"w{i}": torch.randn(1000) for i in range(4)}}
    root = tmp_path / "root"
    with flashckpt.Checkpointer(
        root,
        memory_tier=tmp_path / "mem",
        async_save=True,
        chunk_size="8KiB",
        fsync=False,
        promotion=Promotion(max_queued=1, on_full="wait"),
    ) as ck:
        for step in (1, 2, 3):
            state["m"]["w0"].add_(1)
            ck.save(step, state).wait()
        give_up = time.monotonic() + 60
        while not (root / "steps" / "000000000001.json").exists():
            assert time.monotonic() < give_up, "the promotion of step 1 did not finish"
            time.sleep(0.01)
        first = list(recorder.seen)
        assert first and set(first) == {os.SCHED_OTHER}, first
