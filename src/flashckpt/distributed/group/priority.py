"""CPU priority of the background threads distributed/ owns (Linux: per-thread nice)."""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from typing import Any, TypeVar

log = logging.getLogger(__name__)
T = TypeVar("T")


BACKGROUND_NICE = 10


def background_priority() -> None:
    """Lower the calling thread's CPU priority (Linux: per-thread nice): when training and
    replication compete for a core, the scheduler gives it to training, so replication, which
    training never waits for, takes longer instead of slowing the steps."""
    get_id = getattr(threading, "get_native_id", None)
    if get_id is None or not hasattr(os, "setpriority"):  # pragma: no cover - not Linux
        return
    try:
        tid = get_id()
        os.setpriority(
            os.PRIO_PROCESS, tid, max(os.getpriority(os.PRIO_PROCESS, tid), BACKGROUND_NICE)
        )
    except OSError as exc:  # pragma: no cover - a sandbox refusing it
        log.debug("could not lower the replication thread's priority: %s", exc)


def with_background_priority(fn: Callable[[], T]) -> T:
    """``fn()`` called on a short-lived thread of background priority, its result returned (or
    its exception raised) here. Threads inherit the nice value of the thread that starts them,
    so a gloo group created this way runs its worker and transport threads, which do the
    copies and socket I/O of every send and receive, at background priority too."""
    box: list[Any] = []

    def run() -> None:
        background_priority()
        try:
            box.append((True, fn()))
        except BaseException as exc:  # re-raised on the caller's thread
            box.append((False, exc))

    t = threading.Thread(target=run, name="flashckpt-side-group", daemon=True)
    t.start()
    t.join()
    ok, value = box[0]
    if not ok:
        raise value
    return value  # type: ignore[no-any-return]
