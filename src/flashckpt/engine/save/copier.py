"""Staging copies on every core while the loop waits for them.

A staging copy runs on the stager thread, one chunk after another, beside training. When the
loop stops to wait for it (the optimizer hook waiting for staging, a save of a state without an
optimizer, a foreground save, a caller's ``handle.staged.result()``: every wait goes through the
handle, engine/runtime/priority.py), the cores training used are idle. So while something waits,
:meth:`Copier.copy` splits each chunk's copy into page-aligned parts: the stager copies one and
each helper thread another, and the chunk is staged when all are done. Beside training a chunk
is copied by the stager alone, as before: a second copying thread would take a core from the
steps.

The helpers are save threads: they register with the save's priority (``thread_start``), so they
run at the background level beside training and at full speed while waited on, like the stager.
A copy is numpy's (``np.copyto``, ``np.concatenate``), which releases the GIL: the parts do run
at once. Not ``Tensor.copy_``: from a background thread torch starts an intra-op thread team of
its own that fights the training thread's for the cores (3-40x slower and erratic on a busy
host). All the pieces of a chunk go in one call (a pack of small tensors: 1 us per call).
Measured on the 2-core VM (dispatch loop, 256 MiB in 49 chunks): see BENCHMARKS.md, "What a
save costs the loop".
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

PAGE = 4096
SPLIT_MIN = 1 << 20  # a smaller chunk is copied whole: a hand-off costs tens of microseconds
MAX_HELPERS = 3  # memory bandwidth, not cores, bounds a copy beyond a few threads


def copy_helpers() -> int:
    """Helper threads for this process: one fewer than its cores, at most :data:`MAX_HELPERS`."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    return max(0, min(MAX_HELPERS, cpus - 1))


class Copier:
    def __init__(
        self,
        *,
        helpers: int = 0,
        waited: Callable[[], bool] = lambda: False,
        thread_start: Callable[[], None] | None = None,
    ) -> None:
        """``helpers``: threads besides the stager (0, the default: every copy is the
        caller's, in one numpy call); ``waited``: whether something waits for the save now."""
        self.helpers = max(0, helpers)
        self._waited = waited
        self._pool = (
            ThreadPoolExecutor(
                self.helpers, thread_name_prefix="flashckpt-copy", initializer=thread_start
            )
            if self.helpers
            else None
        )

    def copy(self, buf: np.ndarray, views: list[np.ndarray]) -> int:
        """Copy the flat ``uint8`` arrays ``views``, in order, into ``buf`` (their total size);
        returns into how many parts it was split (1: the caller copied it whole). Raises the
        first part's error once every part has ended."""
        if self._pool is None or buf.size < SPLIT_MIN or not self._waited():
            copy_into(buf, views)
            return 1
        parts = split(buf, views, self.helpers + 1)
        futures: list[Future[None]] = []
        try:
            for dst, src in parts[1:]:
                futures.append(self._pool.submit(copy_into, dst, src))
        except RuntimeError:  # shut down (close racing a save): the caller copies the rest
            for dst, src in parts[1 + len(futures) :]:
                copy_into(dst, src)
        error: BaseException | None = None
        try:
            copy_into(*parts[0])
        except BaseException as exc:
            error = exc
        for f in futures:  # every part ends before the chunk's range may be given back
            failed = f.exception()
            if error is None:
                error = failed
        if error is not None:
            raise error
        return len(parts)

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)


def copy_into(buf: np.ndarray, views: list[np.ndarray]) -> None:
    """One numpy call: the GIL is released for the copy, whatever the number of pieces."""
    if len(views) == 1:
        np.copyto(buf, views[0])
    else:
        np.concatenate(views, out=buf)


def split(
    buf: np.ndarray, views: list[np.ndarray], n: int
) -> list[tuple[np.ndarray, list[np.ndarray]]]:
    """``buf`` and the pieces ``views`` cut into at most ``n`` parts of about equal size at
    page boundaries of ``buf``: each part's destination and the slices of the pieces that
    land in it, in order."""
    size = buf.size
    step = max(PAGE, -(-size // n // PAGE) * PAGE)
    cuts = [*range(0, size, step), size]
    parts: list[tuple[np.ndarray, list[np.ndarray]]] = []
    i, offset = 0, 0  # the next byte to place: views[i][offset]
    for lo, hi in itertools.pairwise(cuts):
        pieces: list[np.ndarray] = []
        pos = lo
        while pos < hi:
            v = views[i]
            take = min(v.size - offset, hi - pos)
            pieces.append(v[offset : offset + take])
            pos += take
            offset += take
            if offset == v.size:
                i, offset = i + 1, 0
        parts.append((buf[lo:hi], pieces))
    return parts
