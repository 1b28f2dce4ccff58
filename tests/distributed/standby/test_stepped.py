"""``role.say_stepped``: a process started by ``flashckpt run`` says ``stepped`` once, on its
pipe, and never writes into a descriptor that is no longer that pipe."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from flashckpt.distributed.standby import role as roles


def test_it_says_stepped_once_and_closes_the_pipe(monkeypatch: pytest.MonkeyPatch) -> None:
    r, w = os.pipe()
    monkeypatch.setenv(roles.ENV_STEPPED_FD, str(w))
    roles.say_stepped()
    roles.say_stepped()  # the variable is gone: nothing a second time
    assert os.read(r, 64) == b"stepped\n"
    assert os.read(r, 64) == b""  # the write end is closed: the launcher sees end of file
    os.close(r)
    assert roles.ENV_STEPPED_FD not in os.environ


def test_a_descriptor_reused_for_a_file_is_left_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fd = os.open(tmp_path / "data.bin", os.O_WRONLY | os.O_CREAT)
    try:
        monkeypatch.setenv(roles.ENV_STEPPED_FD, str(fd))
        roles.say_stepped()
        os.fstat(fd)  # still open: the script's file is not closed under it
    finally:
        os.close(fd)
    assert (tmp_path / "data.bin").read_bytes() == b""


@pytest.mark.parametrize("value", ["", "x", "-1", "999999"])
def test_a_bad_variable_is_ignored(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv(roles.ENV_STEPPED_FD, value)
    roles.say_stepped()
    assert roles.ENV_STEPPED_FD not in os.environ


def test_the_checkpointer_says_it_at_the_first_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch

    import flashckpt

    r, w = os.pipe()
    os.set_blocking(r, False)
    monkeypatch.setenv(roles.ENV_STEPPED_FD, str(w))
    state = {"w": torch.zeros(4)}
    with flashckpt.Checkpointer(tmp_path / "root", async_save=False) as ckpt:
        assert ckpt.restore(state) is None
        with pytest.raises(BlockingIOError):
            os.read(r, 64)  # opening and restoring is not a step
        ckpt.save(1, state)
        assert os.read(r, 64) == b"stepped\n"
    os.close(r)


def _active(stepped_r: int, proc: object = None, *, generation: int = 1, standby: bool = False):
    from flashckpt.distributed.standby.procs import Member, RankSet

    member = Member(proc=proc, rank=0, stepped_r=stepped_r)  # type: ignore[arg-type]
    return RankSet(generation=generation, standby=standby, port=None, members=[member])


def test_the_launcher_starts_a_standby_at_the_first_step_or_after_settle_max() -> None:
    import time

    from flashckpt.distributed.standby import supervise
    from flashckpt.distributed.standby.supervise import Supervisor

    sup = Supervisor(["true"], standby=1, say=lambda _: None)
    r, w = os.pipe()
    os.set_blocking(r, False)
    sup.active = _active(r)
    assert not sup._settled()  # started, not stepped yet
    sup.active.active_t -= supervise.SETTLE_MAX_S + 1
    assert sup._settled()  # a script that never steps through a Checkpointer
    sup.active.active_t = time.time()
    os.write(w, roles.STEPPED + b"\n")
    assert sup._settled() and sup._settled()  # said once, remembered
    os.close(w)
    r2, w2 = os.pipe()
    os.set_blocking(r2, False)
    sup.active = _active(r2)
    os.close(w2)  # closed without a word: it died, or its script closed the descriptor
    assert not sup._settled() and not sup._settled()
    sup.active.active_t -= supervise.SETTLE_MAX_S + 1
    assert sup._settled()  # a script that closed it: the settle time starts the standby


class _Dying:
    """A member's process the test killed: its pipe is at end of file before the launcher can
    reap it (the kernel closes a dying process's files first), so ``poll`` still says running
    for one look."""

    pid = 0

    def __init__(self) -> None:
        self.looks = 0

    def poll(self) -> int | None:
        self.looks += 1
        return None if self.looks == 1 else -9


def test_a_death_is_not_read_as_a_first_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """A takeover killed before its first step: the launcher's first look sees the stepped pipe
    at end of file while the process cannot be reaped yet. It must not start a standby then
    (the failure, seen one look later, would promote that fresh standby instead of restarting
    cold); found as a flaky test_takeover.py::test_two_quick_failures_in_a_row on a loaded CI VM."""
    from flashckpt.distributed.standby.procs import RankSet
    from flashckpt.distributed.standby.supervise import Supervisor

    started: list[bool] = []
    pipes: list[int] = []

    def start(self: Supervisor, *, standby: bool) -> RankSet:  # a set that has not stepped
        started.append(standby)
        r, w = os.pipe()
        os.set_blocking(r, False)
        pipes.extend((r, w))
        return _active(r, _Dying(), generation=len(started) + 1, standby=standby)

    monkeypatch.setattr(Supervisor, "_start", start)
    sup = Supervisor(["true"], standby=1, say=lambda _: None)
    r, w = os.pipe()
    os.set_blocking(r, False)
    os.close(w)  # it died without a word
    sup.active = _active(r, _Dying())
    assert sup._tick() is None  # alive at this look: nothing to do, and no standby
    assert started == [] and sup.spare is None
    monkeypatch.setattr(RankSet, "end", lambda self, timeout_s=10.0: None)
    assert sup._tick() is None  # the failure: restarted cold
    assert started == [False] and sup.counts["cold_restarts"] == 1
    for fd in pipes:
        os.close(fd)
