"""The standby's side: wait, at idle priority, until the launcher says the active writer died
and the kernel has released its writer lock; then run at normal priority as the active one.

``Checkpointer.restore()`` (and any other first use) of a standby calls
:func:`wait_for_takeover`, which

1. prewarms what does not change state: the imports the first optimizer step makes (torch
   2.13's ``AdamW.step`` imports ``torch._dynamo`` on first use);
2. tells the launcher it is ready (one line on the ready pipe, when there is one);
3. blocks on the launcher's pipe (no CPU) until the ``go`` line; end of file without it means
   the launcher is gone: the process exits with :data:`~.role.EXIT_ORPHANED`, having opened
   nothing under the root;
4. polls the root's writer lock read-only (:func:`flashckpt.store.lock.writer_holder`) until no
   process holds it (a writer killed with SIGKILL holds it until the kernel reaps it);
5. restores normal CPU priority on every thread of the process and clears the standby
   variables from the environment, so the Checkpointer then opens the root as usual.

Nothing here writes under the root.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

from flashckpt.distributed.standby import role as roles
from flashckpt.engine.cpupolicy import back_to_normal
from flashckpt.errors import LockedError
from flashckpt.store.lock import writer_holder

log = logging.getLogger(__name__)
LOCK_WAIT_S = 120.0  # a dead writer's lock outliving the launcher's "go" by this much: refuse


@dataclass(frozen=True, kw_only=True)
class Takeover:
    """Times of one takeover (wall clock, ``time.time()``)."""

    waiting_t: float  # the standby reached restore() and began to wait
    ready_t: float  # prewarmed: waiting for the launcher from here
    seen_dead_t: float | None  # when the launcher saw the active process die
    woke_t: float  # the go line arrived and the dead writer's lock was free
    priority_restored: bool


def wait_for_takeover(role: roles.Role, root: Path) -> Takeover:
    """Block until this standby is to take over (see the module); returns its times."""
    waiting_t = time.time()
    prewarm()
    ready_t = time.time()
    _say_ready()
    seen = _read_go(role.fd)
    deadline = time.monotonic() + LOCK_WAIT_S
    while (holder := writer_holder(root, name=role.lock_name)) is not None:
        if time.monotonic() > deadline:
            raise LockedError(
                f"the standby was told to take over {root} but process {holder} still holds "
                f"its writer lock {role.lock_name!r} after {LOCK_WAIT_S:.0f} s; stop that process"
            )
        time.sleep(0.002)
    woke_t = time.time()
    restored = normal_priority() if role.idle else True
    roles.became_active()
    return Takeover(
        waiting_t=waiting_t,
        ready_t=ready_t,
        seen_dead_t=seen,
        woke_t=woke_t,
        priority_restored=restored,
    )


def prewarm() -> None:
    """Import what the first optimizer step would import (best effort: a failure here only
    means the first step pays for it)."""
    try:
        import torch._dynamo  # noqa: F401  (AdamW.step's first call imports it)
    except Exception as exc:  # pragma: no cover - depends on the torch build
        log.info("standby prewarm: torch._dynamo did not import (%s)", exc)


def _say_ready() -> None:
    fd = os.environ.pop(roles.ENV_READY_FD, None)
    if fd is None:
        return
    with contextlib.suppress(OSError, ValueError):
        os.write(int(fd), b"ready\n")
        os.close(int(fd))


def _read_go(fd: int) -> float | None:
    """The launcher's ``go <t>`` line (``t``: when it saw the death); exits on end of file."""
    buf = b""
    while not buf.endswith(b"\n"):
        try:
            part = os.read(fd, 64)
        except InterruptedError:  # pragma: no cover - PEP 475 retries
            continue
        if not part:
            log.warning("standby: the launcher is gone before a takeover; exiting")
            os._exit(roles.EXIT_ORPHANED)
        buf += part
    with contextlib.suppress(OSError):
        os.close(fd)
    words = buf.split()
    if not words or words[0] != roles.GO:
        log.warning("standby: unexpected message %r from the launcher; exiting", buf[:64])
        os._exit(roles.EXIT_ORPHANED)
    try:
        return float(words[1])
    except (IndexError, ValueError):
        return None


def normal_priority() -> bool:
    """Every thread of this process back to ``SCHED_OTHER`` (the launcher started the standby
    under ``SCHED_IDLE`` or ``SCHED_BATCH``, which its threads inherited). False when the
    kernel refused."""
    ok = True
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        tids = [0]
    for tid in tids:
        try:
            back_to_normal(tid)
        except (OSError, AttributeError) as exc:
            if not isinstance(exc, ProcessLookupError):
                ok = False
    if not ok:
        log.warning(
            "standby takeover: could not restore normal CPU priority on every thread (the "
            "kernel refused SCHED_OTHER); training continues at idle priority"
        )
    return ok
