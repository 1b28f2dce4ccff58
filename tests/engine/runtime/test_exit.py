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


MEMORY = """
import sys, time, torch, flashckpt
from flashckpt.store.store import CheckpointStore

real = CheckpointStore.put_chunk
def slow(self, *a, **kw):
    time.sleep(0.3)
    return real(self, *a, **kw)
CheckpointStore.put_chunk = slow

ck = flashckpt.Checkpointer({root!r}, memory_tier={mem!r}, async_save=True, chunk_size="64KiB",
                            compression="zstd", persist_workers=2)
torch.manual_seed(0)
model = torch.nn.Linear(256, 256)
opt = torch.optim.AdamW(model.parameters())
model(torch.randn(2, 256)).sum().backward()
opt.step()
handle = ck.save(4, {{"model": model, "optim": opt}})
print("in-flight", not handle.durable.done(), flush=True)
{ending}
"""


@pytest.mark.parametrize(
    ("ending", "code"),
    [("pass", 0), ("raise RuntimeError('training crashed')", 1)],
    ids=["normal-exit", "exception"],
)
def test_exit_without_close_with_a_memory_tier_finishes_and_promotes(tmp_path, ending, code):
    """The same with a memory tier (a tmp dir), model and optimizer (staging overlaps the
    next step): the step is committed in the memory tier and promoted to disk, and a second
    process restores it bitwise from either."""
    root, mem = tmp_path / "root", tmp_path / "mem"
    src = textwrap.dedent(MEMORY.format(root=str(root), mem=str(mem), ending=ending))
    res = subprocess.run([sys.executable, "-c", src], capture_output=True, timeout=240)
    err = res.stderr.decode(errors="replace")
    assert res.returncode == code, err
    assert "in-flight True" in res.stdout.decode(), "the save was over before the exit"
    assert "cannot schedule new futures" not in err and "abandoned" not in err, err
    torch.manual_seed(0)  # the script's model after its one step, bit for bit
    want = torch.nn.Linear(256, 256)
    step = torch.optim.AdamW(want.parameters())
    want(torch.randn(2, 256)).sum().backward()
    step.step()
    for where in ({"memory_tier": str(mem)}, {}):  # the memory-tier copy, then the disk's
        got = torch.nn.Linear(256, 256)
        with flashckpt.Checkpointer(root, keep_memory_after_close=True, **where) as ck:
            assert ck.restore({"model": got}, strict=False) == 4
        assert torch.equal(got.weight, want.weight) and torch.equal(got.bias, want.bias)
    assert (root / "steps" / "000000000004.json").is_file()  # promoted before the exit
    assert (mem / "steps" / "000000000004.json").is_file()


def test_forked_child_exiting_does_not_wait_for_the_parents_save(tmp_path):
    """The child's copy of the save in flight never completes (its threads stayed in the
    parent); the exit hook must leave it alone instead of waiting for it."""
    src = textwrap.dedent(FORK.format(root=str(tmp_path)))
    res = subprocess.run([sys.executable, "-c", src], capture_output=True, timeout=240)
    out = res.stdout.decode()
    assert res.returncode == 0, res.stderr.decode(errors="replace")
    assert "child-exited 0 False" in out  # the child was gone before the parent's save ended
    assert flashckpt.restore(tmp_path, {"w": torch.empty(100000)}) == 3


ORDER = """
import threading
import flashckpt.engine.runtime.exit as ours
import concurrent.futures.process  # a later import registers its own hook too
import concurrent.futures.thread as pool
funcs = [c.func for c in threading._threading_atexits]
# threading._shutdown calls them newest first (CPython 3.11: reversed(_threading_atexits))
print(funcs.index(ours._at_exit) > funcs.index(pool._python_exit))
"""


def test_the_exit_hook_runs_before_the_thread_pools_stop():
    """The ordering the fix rests on, checked in a fresh interpreter: flashckpt's hook is
    registered after concurrent.futures.thread's, so it runs first and the pools still take
    work (flashckpt uses thread pools only; the process pool's hook does not stop them)."""
    res = subprocess.run([sys.executable, "-c", ORDER], capture_output=True, timeout=120)
    assert res.stdout.decode().strip() == "True", res.stderr.decode(errors="replace")
