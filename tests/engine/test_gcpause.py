"""The cyclic collector is held off while a save builds its per-tensor objects
(engine/gcpause.py), and left as the program had it afterwards."""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator

import pytest
import torch

import flashckpt
from flashckpt.engine import gcpause
from flashckpt.engine.gcpause import paused_gc


@pytest.fixture(autouse=True)
def _gc_enabled() -> Iterator[None]:
    was = gc.isenabled()
    gc.enable()
    yield
    assert gcpause._depth == 0  # no pause left behind
    if not was:
        gc.disable()


class Probe:
    """A Stateful that records whether the collector ran automatically during capture."""

    def __init__(self) -> None:
        self.seen: list[bool] = []

    def state_dict(self) -> dict:
        self.seen.append(gc.isenabled())
        return {"w": torch.ones(3)}

    def load_state_dict(self, sd: dict) -> None:
        pass


def test_pause_restores_the_collector() -> None:
    with paused_gc():
        assert not gc.isenabled()
        with paused_gc():  # nested: still paused after the inner block
            pass
        assert not gc.isenabled()
    assert gc.isenabled()


def test_a_disabled_collector_stays_disabled() -> None:
    gc.disable()
    with paused_gc():
        assert not gc.isenabled()
    assert not gc.isenabled()


def test_overlapping_pauses_of_two_threads() -> None:
    """The collector comes back only when the last of two overlapping pauses ends, whichever
    thread began first."""
    inside, leave = threading.Event(), threading.Event()

    def other() -> None:
        with paused_gc():
            inside.set()
            leave.wait(10)

    t = threading.Thread(target=other)
    with paused_gc():
        t.start()
        assert inside.wait(10)
    assert not gc.isenabled()  # the other thread's pause still runs
    leave.set()
    t.join(10)
    assert gc.isenabled()


def test_pause_ends_on_error() -> None:
    with pytest.raises(RuntimeError), paused_gc():
        raise RuntimeError("boom")
    assert gc.isenabled()


@pytest.mark.parametrize("async_save", [False, True])
def test_save_captures_with_the_collector_paused(tmp_path, async_save: bool) -> None:
    probe = Probe()
    with flashckpt.Checkpointer(tmp_path / "ck", async_save=async_save) as ck:
        ck.save(1, {"p": probe}).wait()
        assert gc.isenabled()  # back on once save() returned
    assert probe.seen == [False]


def test_failed_save_resumes_the_collector(tmp_path) -> None:
    with flashckpt.Checkpointer(tmp_path / "ck") as ck:
        with pytest.raises(flashckpt.errors.UnsupportedStateError):
            ck.save(1, {"bad": {"x": object()}})
    assert gc.isenabled()


class LoadProbe(Probe):
    def __init__(self) -> None:
        super().__init__()
        self.loaded: list[bool] = []

    def load_state_dict(self, sd: dict) -> None:
        self.loaded.append(gc.isenabled())


def test_restore_plans_and_loads_with_the_collector_paused(tmp_path) -> None:
    """A restore after a save in the same process ran twice the full collections it used to
    once saves stopped setting them off (80 against 25-27 us per small tensor, i26s's probe):
    restore holds the collector off too, and gives it back."""
    with flashckpt.Checkpointer(tmp_path / "ck") as ck:
        ck.save(1, {"p": Probe()})
        probe = LoadProbe()
        assert ck.restore({"p": probe}) == 1
        assert gc.isenabled()
    assert probe.loaded == [False]


def test_a_failed_restore_resumes_the_collector(tmp_path) -> None:
    with flashckpt.Checkpointer(tmp_path / "ck") as ck:
        ck.save(1, {"p": Probe()})
        with pytest.raises(flashckpt.errors.StateMismatchError):
            ck.restore({"other": LoadProbe()})
    assert gc.isenabled()
