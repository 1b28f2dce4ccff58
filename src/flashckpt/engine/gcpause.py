"""Python's cyclic garbage collector held off while a save builds its per-tensor objects.

A save makes a handful of small objects per tensor (its capture item, its place in the chunk
layout, its manifest entry). Every 700 such allocations start a collection of the young
generation, and once enough objects survived those, a *full* collection walks every object of
the process (the model's tensors included): for a state of 50,000 small tensors that was 4-5
full collections per save, half its time (a synchronous save of benchmarks/tensor_cost.py's
state: 27.7 us per tensor, 14.7 with the pause). Nothing a save makes is a reference cycle the
collector would need to free; reference counting frees it all. (The save path uses it:
engine/runtime/saving.py, engine/save/job.py; a restore building per-tensor objects can use it
the same way.)

:func:`paused_gc` disables the automatic collector for the duration of a ``with`` block and
enables it again after, only if it was enabled when the first of the overlapping pauses began
(the training thread's ``save()`` and the staging thread's manifest draft may overlap; a
program that runs with ``gc.disable()`` stays that way). ``gc.collect()`` still works inside.
The collector is process-wide, so while a pause lasts (the capture and layout of one save, or
the manifest draft on the staging thread: well under a second for 50,000 tensors) cyclic
garbage the training thread makes waits for the next collection; reference-counted memory is
freed as always. A program that calls ``gc.disable()`` itself inside that window has the
collector enabled again when the window ends.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from contextlib import contextmanager

_lock = threading.Lock()
_depth = 0  # pauses in progress, all threads together
_resume = False  # whether the collector was enabled when the outermost pause began


@contextmanager
def paused_gc() -> Iterator[None]:
    """Hold off automatic garbage collection for the block (see the module docstring)."""
    global _depth, _resume
    with _lock:
        if _depth == 0:
            _resume = gc.isenabled()
            if _resume:
                gc.disable()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _resume:
                _resume = False
                gc.enable()
