"""A standby's Checkpointer: opened at the takeover, not when it is built.

In a process ``flashckpt run`` started as a standby (distributed/standby/role.py), the Checkpointer
keeps its ``_open`` call as a :class:`Pending` and opens nothing (no lock, no journal, no tier,
no thread). Its first use (``restore()``, normally) calls :func:`take_over`, which waits at idle
priority until the active process is gone (distributed/standby/wait.py), opens the root as the
active writer (the dead writer's run marker is there, so the restart is timed as any other),
moves the modules ``flashckpt.to_device`` deferred (distributed/standby/placement.py), and journals
one ``takeover`` event; the ``restart`` event at the first resumed step then carries
``takeover: true`` with ``wait_s`` (kill -> the standby woke) and ``open_s`` (woke -> the
restore began) as its ``down_s`` and ``start_s`` (engine/runtime/restart.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from flashckpt.distributed.standby import placement
from flashckpt.distributed.standby.role import Role, from_env
from flashckpt.distributed.standby.wait import wait_for_takeover
from flashckpt.journal import Journal


@dataclass(frozen=True)
class Pending:
    """A standby Checkpointer's deferred opening."""

    role: Role
    opening: Callable[[], None]


class Opened(Protocol):
    root: Path
    journal: Journal
    _marker: Any


def pending(opening: Callable[[], None]) -> Pending | None:
    """A :class:`Pending` in a standby process; None otherwise (open now)."""
    role = from_env()
    return None if role is None else Pending(role, opening)


def take_over(p: Pending, ckpt: Opened) -> None:
    """Wait for the takeover, then open (see the module)."""
    took = wait_for_takeover(p.role, ckpt.root)
    p.opening()
    opened_t = time.time()
    moved = placement.materialise()
    ckpt._marker.took_over(took.woke_t)
    ckpt.journal.append(
        "takeover",
        waiting_t=took.waiting_t,
        ready_t=took.ready_t,
        seen_dead_t=took.seen_dead_t,
        woke_t=took.woke_t,
        idle_s=round(max(0.0, took.woke_t - took.ready_t), 6),
        prewarm_s=round(took.ready_t - took.waiting_t, 6),
        open_s=round(opened_t - took.woke_t, 6),
        moved_modules=moved,
        move_s=round(time.time() - opened_t, 6),
        priority_restored=took.priority_restored,
    )
