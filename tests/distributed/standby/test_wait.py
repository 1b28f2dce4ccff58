"""The standby's side without the launcher: it opens nothing under the root while it waits, exits
when the launcher goes away, waits for a live writer's lock even after ``go``, and defers moving
modules to their device until the takeover."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from flashckpt.distributed.standby import placement, role
from flashckpt.errors import ConfigError
from flashckpt.store.lock import WriterLock, writer_holder

STANDBY = textwrap.dedent(
    """
    import sys, torch, flashckpt
    ckpt = flashckpt.Checkpointer(sys.argv[1])
    state = {"w": torch.zeros(4)}
    step = ckpt.restore(state)
    print("restored", step, flush=True)
    ckpt.close()
    """
)
HOLDER = textwrap.dedent(
    """
    import sys, time
    from flashckpt.store.lock import WriterLock
    WriterLock(sys.argv[1]).acquire()
    print("held", flush=True)
    time.sleep(600)
    """
)


def start_standby(root: Path) -> tuple[subprocess.Popen[str], int, int]:
    go_r, go_w = os.pipe()
    ready_r, ready_w = os.pipe()
    env = {**os.environ, **role.standby_env(fd=go_r, ready_fd=ready_w, lock_name="writer",
                                            idle=False)}  # fmt: skip
    proc = subprocess.Popen(
        [sys.executable, "-c", STANDBY, str(root)],
        env=env,
        pass_fds=(go_r, ready_w),
        stdout=subprocess.PIPE,
        text=True,
    )
    os.close(go_r)
    os.close(ready_w)
    return proc, go_w, ready_r


def wait_ready(ready_r: int) -> None:
    assert os.read(ready_r, 16).startswith(b"ready")  # blocks until the standby waits


def test_a_waiting_standby_opens_nothing_and_exits_with_its_launcher(tmp_path: Path) -> None:
    root = tmp_path / "root"
    proc, go_w, ready_r = start_standby(root)
    wait_ready(ready_r)
    assert not root.exists()  # no lock, no journal, no directory while it waits
    os.close(go_w)  # the launcher is gone
    assert proc.wait(timeout=60) == role.EXIT_ORPHANED
    assert not root.exists()


def test_go_waits_for_a_live_writer_lock(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(root)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        assert writer_holder(root) == holder.pid
        proc, go_w, ready_r = start_standby(root)
        wait_ready(ready_r)
        os.write(go_w, b"go 0\n")
        time.sleep(1.0)
        assert proc.poll() is None  # told to go, but the writer is alive: it waits
        holder.send_signal(signal.SIGKILL)
        holder.wait()
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0 and out.strip() == "restored None"
        assert writer_holder(root) is None
    finally:
        holder.kill()
        holder.wait()


def test_writer_holder_probe_creates_nothing(tmp_path: Path) -> None:
    assert writer_holder(tmp_path / "missing") is None
    assert not (tmp_path / "missing").exists()
    lock = WriterLock(tmp_path)
    lock.acquire()
    try:
        assert writer_holder(tmp_path) is None  # a record lock never conflicts with its owner
    finally:
        lock.release()


def test_a_bad_standby_environment_is_refused() -> None:
    assert role.from_env({}) is None and role.from_env({role.ENV: "0"}) is None
    with pytest.raises(ConfigError, match="FLASHCKPT_STANDBY_FD"):
        role.from_env({role.ENV: "1"})


def test_to_device_is_deferred_in_a_standby(monkeypatch: pytest.MonkeyPatch) -> None:
    """The meta device stands in for a GPU: a real move of every parameter, no memory."""
    lin = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(lin.parameters())
    monkeypatch.setenv(role.ENV, "1")
    assert placement.to_device(lin, "meta") is lin
    assert lin.weight.device.type == "cpu" and placement.deferred() == [(lin, "meta")]
    assert placement.materialise() == 1
    assert lin.weight.device.type == "meta" and placement.deferred() == []
    assert opt.param_groups[0]["params"][0] is lin.weight  # the optimizer's params moved along
    monkeypatch.delenv(role.ENV)
    other = torch.nn.Linear(2, 2)
    placement.to_device(other, "meta")  # not a standby: at once
    assert other.weight.device.type == "meta" and placement.deferred() == []


LAUNCHER = textwrap.dedent(
    """
    import sys
    from flashckpt.distributed.standby import procs
    code = (
        "import os, json; from flashckpt.distributed.standby.wait import normal_priority; "
        "before = os.sched_getscheduler(0); ok = normal_priority(); "
        "print(json.dumps([before, ok, os.sched_getscheduler(0)]), flush=True)"
    )
    rs = procs.start_set([sys.executable, "-c", code], generation=1, nproc=1, standby=True)
    sys.exit(rs.members[0].proc.wait())
    """
)


def test_an_unprivileged_launchers_standby_trains_at_normal_priority_after_its_takeover(
    python_without_sys_nice: Callable[[str], Any],
) -> None:
    """Regression: the launcher started every standby under ``SCHED_IDLE``, which only a
    process that may raise its priority again can leave: an unprivileged launcher's standby
    took over and trained at idle priority for good (a warning said so). Such a launcher now
    starts it under ``SCHED_BATCH``, which the takeover leaves (a launcher that may, as in
    test_takeover.py, still uses ``SCHED_IDLE``)."""
    before, restored, after = python_without_sys_nice(LAUNCHER)
    assert before == os.SCHED_BATCH and restored is True and after == os.SCHED_OTHER
