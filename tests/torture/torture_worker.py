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

``worker ROOT MEM SEED -1 0 0 K`` SIGKILLs itself right after the K-th step manifest it
publishes in MEM, before that save reports (a kill after the manifest).

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
from torture_faults import MANIFEST_RE
from torture_model import build, train_step

import flashckpt
from flashckpt.engine.tiers.promote import Promotion
from flashckpt.store.files.backend import LocalBackend

MEMORY = [""]  # the worker's memory tier (realpath)


def slow_io(seed: int, put_delay_s: float = 0.0, die_after_manifest: int = 0) -> None:
    """Seeded delays on every write and delete; with ``die_after_manifest`` N > 0 the process
    SIGKILLs itself right after the N-th manifest of a step lands in the memory tier (its
    rename done, before the save reports: a kill after the manifest)."""
    rng = random.Random(seed)
    put, delete = LocalBackend.put, LocalBackend.delete
    left = [die_after_manifest]

    def slow_put(self: LocalBackend, path: str, parts: object) -> int:
        time.sleep(put_delay_s + rng.uniform(0.0, 0.004))
        n = put(self, path, parts)  # type: ignore[arg-type]
        if left[0] > 0 and MANIFEST_RE.fullmatch(path) and os.path.realpath(self.root) == MEMORY[0]:
            left[0] -= 1
            if left[0] == 0:
                print(f"killed after the manifest {path}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
        return n

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
    die_after_manifest: str = "0",
) -> int:
    """Train and save until killed or, with ``exit_after`` >= 0, until that many saves were
    started: then leave without close() with the last save in flight, as a script that ends
    (or raises) does. ``put_delay_ms`` slows every write down more (keeps a save in flight);
    ``big_mib`` adds a tensor of that size to the state (staging it takes long enough for the
    script to end first)."""
    seed = int(seed_text)
    MEMORY[0] = os.path.realpath(mem)
    slow_io(seed, int(put_delay_ms) / 1000, int(die_after_manifest))
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
