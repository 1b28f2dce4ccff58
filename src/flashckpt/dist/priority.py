"""CPU priority of the background threads dist/ owns (Linux: per-thread nice)."""

from __future__ import annotations

import logging
import os
import threading

log = logging.getLogger(__name__)


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
