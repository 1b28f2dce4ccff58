"""The kill trials' background loops (run in processes forked by ``torture_worker.py``).

``reader``: a lock-free reader; runs ``flashckpt ls`` and ``flashckpt verify`` on ROOT and MEM
in a loop and prints one JSON line per run: ``{"cmd", "dir", "rc", "damaged": [lines]}``.
``gc_loop``: runs ``flashckpt gc`` on ROOT and MEM in a loop (it is killed at random too).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import random
import time

from torture_model import build, expected, same, snapshot

import flashckpt
from flashckpt.cli import main as cli

_PARENT = os.getppid()


def adopt_parent() -> None:
    """Remember the fork server as this process's parent (called first in each child)."""
    global _PARENT
    _PARENT = os.getppid()


def orphaned() -> bool:
    """True once the fork server is gone (the test run died): the loops then stop."""
    return os.getppid() != _PARENT


def run(*args: str) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            rc = cli(list(args))
        except Exception as exc:  # a crash of the CLI itself is a finding too
            return 99, f"{type(exc).__name__}: {exc}"
    return rc, out.getvalue()


def read_only_restore(root: str) -> dict[str, object] | None:
    """``flashckpt.restore(root, state)`` (the lock-free read-only restore), when the library
    has it: rc 0 ok, 1 it raised (damage reported), 3 it loaded wrong data."""
    restore = getattr(flashckpt, "restore", None)
    if restore is None:
        return None
    state = build()
    try:
        step = restore(root, state)
    except TypeError:
        return None  # another signature: not this harness's business
    except flashckpt.FlashCkptError as exc:
        return {"rc": 1, "damaged": [f"DAMAGED restore: {exc}"]}
    if step is not None and not same(snapshot(state), expected(step)):
        return {"rc": 3, "damaged": [f"step {step} WRONG DATA from flashckpt.restore"]}
    return {"rc": 0, "damaged": []}


def reader(root: str, mem: str) -> int:
    rng = random.Random(root)
    while not orphaned():
        for cmd, d in (("ls", root), ("verify", root), ("verify", mem)):
            rc, text = run(cmd, d)
            bad = [ln for ln in text.splitlines() if "DAMAGED" in ln]
            print(json.dumps({"cmd": cmd, "dir": d, "rc": rc, "damaged": bad}), flush=True)
            time.sleep(rng.uniform(0.02, 0.15))
        res = read_only_restore(root)
        if res is not None:
            print(json.dumps({"cmd": "restore", "dir": root, **res}), flush=True)
    return 0


def gc_loop(root: str, mem: str) -> int:
    rng = random.Random(mem)
    while not orphaned():
        for d in (root, mem):
            rc, _ = run("gc", d)
            print(json.dumps({"cmd": "gc", "dir": d, "rc": rc}), flush=True)
        time.sleep(rng.uniform(0.05, 0.25))
    return 0
