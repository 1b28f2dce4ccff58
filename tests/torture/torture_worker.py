"""Processes of the kill trials, forked from one server that imported torch once.

``python torture_worker.py serve`` prints ``server ready``, then reads commands on stdin, one a
line: ``MODE OUT ARGS...``. For each it forks a child whose stdout and stderr go to the file
OUT, prints the child's pid, and forgets it (children are reaped by the kernel). The test
SIGKILLs the children itself. Modes:

``worker ROOT MEM SEED``  restore the newest checkpoint (memory tier first), then train and
    save every step with a memory tier, promotion to ROOT and retention on both, printing
    ``ready STEP`` once and ``durable STEP`` as each save commits, until killed. Writes and
    deletes are slowed by a few seeded milliseconds so kills land inside saves, promotions and
    retention.
``read ROOT MEM``  a lock-free reader: ``flashckpt ls`` / ``verify`` in a loop, one JSON line a
    run (see :mod:`torture_reader`).
``gc ROOT MEM``  ``flashckpt gc`` on both in a loop.

``worker ROOT MEM SEED N`` with N >= 0 leaves the loop after N saves without ``close()`` and
ends like a script whose last line was ``save()`` (exit safety).
"""

from __future__ import annotations

import atexit
import os
import random
import signal
import sys
import tempfile
import threading
import time
import traceback

import torch
import torture_reader
from torture_model import build, train_step

import flashckpt
from flashckpt.engine.tiers.promote import Promotion
from flashckpt.store.files.backend import LocalBackend


def slow_io(seed: int, put_delay_s: float = 0.0) -> None:
    rng = random.Random(seed)
    put, delete = LocalBackend.put, LocalBackend.delete

    def slow_put(self: LocalBackend, path: str, parts: object) -> int:
        time.sleep(put_delay_s + rng.uniform(0.0, 0.004))
        return put(self, path, parts)  # type: ignore[arg-type]

    def slow_delete(self: LocalBackend, path: str) -> None:
        time.sleep(rng.uniform(0.0, 0.002))
        delete(self, path)

    LocalBackend.put = slow_put  # type: ignore[method-assign]
    LocalBackend.delete = slow_delete  # type: ignore[method-assign]


def open_ckpt(root: str, mem: str, seed: int) -> flashckpt.Checkpointer:
    deadline = time.monotonic() + 60
    while True:  # the gc loop holds the writer lock for a moment now and then
        try:
            return flashckpt.Checkpointer(
                root,
                memory_tier=mem,
                keep=3,
                keep_memory=2,
                async_save=seed % 2 == 0,
                chunk_size="64KiB",
                fsync=seed % 3 == 0,
                promotion=Promotion(retries=3, backoff_s=0.01, max_backoff_s=0.05),
            )
        except flashckpt.LockedError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.01)


def interpreter_exit() -> None:
    """What the interpreter does when a script ends (this process is a fork, so it ends with
    ``os._exit``): join non-daemon threads and run the threading / concurrent.futures exit
    hooks, then the atexit handlers."""
    threading._shutdown()  # type: ignore[attr-defined]
    atexit._run_exitfuncs()
    sys.stdout.flush()


def worker(
    root: str,
    mem: str,
    seed_text: str,
    exit_after: str = "-1",
    put_delay_ms: str = "0",
    big_mib: str = "0",
) -> int:
    """Train and save until killed or, with ``exit_after`` >= 0, until that many saves were
    started: then leave without close() with the last save in flight, as a script that ends
    (or raises) does. ``put_delay_ms`` slows every write down more (keeps a save in flight);
    ``big_mib`` adds a tensor of that size to the state (staging it takes long enough for the
    script to end first)."""
    seed = int(seed_text)
    slow_io(seed, int(put_delay_ms) / 1000)
    ckpt = open_ckpt(root, mem, seed)
    state = build()
    if int(big_mib):
        state["big"] = torch.zeros(int(big_mib) << 18)
    last = ckpt.restore(state)
    start = -1 if last is None else last
    print(f"ready {start}", flush=True)
    for n, step in enumerate(range(start + 1, start + 1_000_000)):
        if torture_reader.orphaned():
            return 1
        if n == int(exit_after):
            print(f"exiting with step {step - 1} in flight", flush=True)
            interpreter_exit()
            return 0
        train_step(state, step)
        handle = ckpt.save(step, state)
        handle.durable.add_done_callback(
            lambda f, s=step: f.exception() is None and print(f"durable {s}", flush=True)
        )
    return 0


MODES = {"worker": worker, "read": torture_reader.reader, "gc": torture_reader.gc_loop}


def child(mode: str, out: str, args: list[str]) -> None:
    rc = 1
    try:
        fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
        sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        torture_reader.adopt_parent()
        rc = MODES[mode](*args)
    except BaseException:
        traceback.print_exc()
    finally:
        os._exit(rc)


def warm_up() -> None:
    """Save, restore and run the CLI once so every lazy import happens here, not in each
    forked child (Checkpointer() alone imports torch.distributed: seconds on a busy host)."""
    with tempfile.TemporaryDirectory() as d:
        root, mem = f"{d}/root", f"{d}/mem"
        ckpt = open_ckpt(root, mem, 0)
        state = build()
        train_step(state, 0)
        ckpt.save(0, state).durable.result()
        ckpt.restore(build())
        ckpt.wait_promoted()
        ckpt.close()
        for cmd in ("ls", "verify", "gc"):
            torture_reader.run(cmd, root)


def serve() -> int:
    torch.set_num_threads(1)
    warm_up()
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the kernel reaps the children
    print("server ready", flush=True)
    for line in sys.stdin:
        mode, out, *args = line.split()
        sys.stdout.flush()
        pid = os.fork()
        if pid == 0:
            child(mode, out, args)
        print(pid, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(serve())
