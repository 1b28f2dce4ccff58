"""What this process may do with CPU scheduling priorities, decided once: the one owner of the
question "can a priority lowered here be raised again?" for the engine's save threads
(:mod:`flashckpt.engine.runtime.priority`) and the launcher's standby
(:mod:`flashckpt.distributed.standby.procs`, :mod:`~flashckpt.distributed.standby.wait`).

Lowering is always allowed; raising back (a nice value down again, ``SCHED_IDLE`` back to
``SCHED_OTHER``) needs root with ``CAP_SYS_NICE``, or an ``RLIMIT_NICE`` of at least 20. A level
that cannot be undone is never set: a thread the loop waits for, or a standby that takes over,
must get its priority back.
"""

from __future__ import annotations

import os
import threading

BATCH = getattr(os, "SCHED_BATCH", None)  # None where the policies do not exist
OTHER = getattr(os, "SCHED_OTHER", None)


def may_raise_priority() -> bool:
    """Whether this process may take a thread back to normal priority after lowering it (a
    nice value back down, ``SCHED_IDLE`` back to ``SCHED_OTHER``). Tried once per process on a
    throwaway thread, so every reason for a refusal counts (no root, no ``CAP_SYS_NICE``, an
    ``RLIMIT_NICE`` below 20, a sandbox); reading the effective uid alone said yes to a root
    whose ``CAP_SYS_NICE`` was dropped, as container runtimes may."""
    global _may_raise
    if _may_raise is None:
        _may_raise = _probe()
    return _may_raise


_may_raise: bool | None = None


def _probe() -> bool:
    get_id = getattr(threading, "get_native_id", None)
    if get_id is None or not hasattr(os, "setpriority") or not hasattr(os, "sched_setscheduler"):
        return False
    box: list[bool] = []

    def run() -> None:
        tid = get_id()
        try:
            nice = os.getpriority(os.PRIO_PROCESS, tid)
            os.setpriority(os.PRIO_PROCESS, tid, min(nice + 1, 19))
            os.setpriority(os.PRIO_PROCESS, tid, nice)
            idle = getattr(os, "SCHED_IDLE", None)
            if idle is not None:
                policy = os.sched_getscheduler(tid)
                os.sched_setscheduler(tid, idle, os.sched_param(0))
                os.sched_setscheduler(tid, policy, os.sched_param(0))
            box.append(True)
        except OSError:
            box.append(False)

    t = threading.Thread(target=run, name="flashckpt-priority-probe", daemon=True)
    t.start()
    t.join()
    return bool(box and box[0])


def lowest_undoable_policy() -> int | None:
    """The lowest scheduling policy to start a process under that this process can later take
    back to ``SCHED_OTHER``: ``SCHED_IDLE`` where it may raise priority again (leaving
    ``SCHED_IDLE`` needs what nice 0 needs), else ``SCHED_BATCH``, which anyone may leave; None
    where the calls do not exist (not Linux). A warm standby started under ``SCHED_IDLE`` by
    an unprivileged launcher trained at idle priority for good after its takeover."""
    if not hasattr(os, "sched_setscheduler"):
        return None
    idle = getattr(os, "SCHED_IDLE", None)
    return idle if idle is not None and may_raise_priority() else BATCH


def back_to_normal(tid: int) -> None:
    """Thread ``tid`` from a policy :func:`lowest_undoable_policy` gave it back to
    ``SCHED_OTHER`` (others are left alone); OSError as the kernel raises it."""
    if os.sched_getscheduler(tid) in (getattr(os, "SCHED_IDLE", None), BATCH):
        os.sched_setscheduler(tid, OTHER, os.sched_param(0))  # type: ignore[arg-type]
