"""Exit safety: a process that ends with a save in flight finishes it (or says it did not).

When the main thread ends (normally or by an uncaught exception) Python first runs the
callbacks registered with ``threading._register_atexit``, newest first, then joins the threads.
``concurrent.futures`` registers one that stops every executor from taking work, which would
make the save in flight fail with "cannot schedule new futures after interpreter shutdown".
This module registers its own callback after that one (so it runs first): every Checkpointer
still open gets :meth:`Checkpointer.at_exit`, which waits for its save in flight (up to
``EXIT_WAIT_S``) and journals ``save_abandoned`` when it could not finish. It does not close
the Checkpointer: a run that never called ``close()`` is still reported as crashed by the next
run (engine/runtime/lifecycle.py).
"""

from __future__ import annotations

import concurrent.futures.thread  # noqa: F401 - its exit hook must be registered before ours
import logging
import os
import threading
import weakref
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from flashckpt.engine.runtime.inflight import InFlight
    from flashckpt.journal import Journal

log = logging.getLogger(__name__)

EXIT_WAIT_S = 600.0


class _Exits(Protocol):
    def at_exit(self, wait_s: float) -> None: ...


_open: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()  # -> creating pid
_lock = threading.Lock()


def track(obj: _Exits) -> None:
    with _lock:
        _open[obj] = os.getpid()


def untrack(obj: _Exits) -> None:
    with _lock:
        _open.pop(obj, None)


def _at_exit() -> None:
    with _lock:  # a forked child has the objects but not their threads: not its business
        pending = [obj for obj, pid in _open.items() if pid == os.getpid()]
    for obj in pending:
        try:
            obj.at_exit(EXIT_WAIT_S)
        except BaseException:  # never let one Checkpointer stop the others at exit
            log.exception("flashckpt: finishing an unclosed Checkpointer at exit failed")


_register = getattr(threading, "_register_atexit", None)
if _register is not None:
    _register(_at_exit)
else:  # pragma: no cover - every supported CPython has it
    import atexit

    atexit.register(_at_exit)


def finish_in_flight(inflight: InFlight, journal: Journal, wait_s: float) -> bool:
    """Wait for the save in flight at exit; False (journaled, logged) when it was abandoned."""
    handle = inflight.handle
    if handle is None:
        return True
    if not handle.done():
        log.warning(
            "process exiting without Checkpointer.close() while checkpoint step %d is in "
            "flight: finishing it (call close() at the end of training)",
            handle.step,
        )
    if inflight.wait_durable_for(wait_s):
        return True
    journal.append("save_abandoned", step=handle.step, reason="process exit")
    log.error(
        "checkpoint step %d abandoned at process exit after %.0fs; older checkpoints are intact",
        handle.step,
        wait_s,
    )
    return False
