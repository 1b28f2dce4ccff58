"""Exit safety: a process that ends with an async save in flight and no close() finishes it
(real subprocesses; the save is held in flight by slow chunk writes)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch

import flashckpt

SCRIPT = """
import time, torch, flashckpt
from flashckpt.store.store import CheckpointStore

real = CheckpointStore.put_chunk
def slow(self, *a, **kw):
    time.sleep(0.5)
    return real(self, *a, **kw)
CheckpointStore.put_chunk = slow

ck = flashckpt.Checkpointer({root!r}, async_save=True, chunk_size="64KiB", persist_workers=2)
handle = ck.save(7, {{"w": torch.arange(200000, dtype=torch.float32)}})
assert not handle.done()
{ending}
"""


@pytest.mark.parametrize(
    ("ending", "code"),
    [("pass", 0), ("raise RuntimeError('training crashed')", 1)],
    ids=["normal-exit", "exception"],
)
def test_exit_without_close_finishes_the_save_in_flight(tmp_path, ending, code):
    """It always failed with "cannot schedule new futures after interpreter shutdown"."""
    src = textwrap.dedent(SCRIPT.format(root=str(tmp_path), ending=ending))
    res = subprocess.run([sys.executable, "-c", src], capture_output=True, timeout=240)
    err = res.stderr.decode(errors="replace")
    assert res.returncode == code, err
    assert "cannot schedule new futures" not in err
    assert "finishing it" in err  # the warning says close() was not called
    out = {"w": torch.empty(200000)}
    assert flashckpt.restore(tmp_path, out) == 7
    assert torch.equal(out["w"], torch.arange(200000, dtype=torch.float32))
    events = [json.loads(x)["event"] for x in (tmp_path / "journal.jsonl").read_text().splitlines()]
    assert "durable" in events and "save_failed" not in events


FORK = """
import os, sys, threading, torch, flashckpt
from flashckpt.store.store import CheckpointStore

child_gone = threading.Event()
real = CheckpointStore.put_chunk
def held(self, *a, **kw):
    child_gone.wait(120)  # the save stays in flight until the forked child has exited
    return real(self, *a, **kw)
CheckpointStore.put_chunk = held

ck = flashckpt.Checkpointer({root!r}, async_save=True, chunk_size="64KiB", persist_workers=1)
handle = ck.save(3, {{"w": torch.arange(100000, dtype=torch.float32)}})
pid = os.fork()
if pid == 0:
    sys.exit(0)  # the child has the Checkpointer but none of its threads
_, status = os.waitpid(pid, 0)
print("child-exited", os.waitstatus_to_exitcode(status), handle.done(), flush=True)
child_gone.set()
ck.close()
"""


def test_forked_child_exiting_does_not_wait_for_the_parents_save(tmp_path):
    """The child's copy of the save in flight never completes (its threads stayed in the
    parent); the exit hook must leave it alone instead of waiting for it."""
    src = textwrap.dedent(FORK.format(root=str(tmp_path)))
    res = subprocess.run([sys.executable, "-c", src], capture_output=True, timeout=240)
    out = res.stdout.decode()
    assert res.returncode == 0, res.stderr.decode(errors="replace")
    assert "child-exited 0 False" in out  # the child was gone before the parent's save ended
    assert flashckpt.restore(tmp_path, {"w": torch.empty(100000)}) == 3
