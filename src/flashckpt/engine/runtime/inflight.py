"""The save in flight (never more than one) and the background error nobody has seen yet."""

from __future__ import annotations

import threading
import time
from concurrent.futures import TimeoutError as FutureTimeout

from flashckpt.engine.save.handle import SaveHandle, as_save_error, settle
from flashckpt.engine.save.job import SaveJob


class InFlight:
    def __init__(self) -> None:
        self.handle: SaveHandle | None = None
        self.job: SaveJob | None = None
        self._error: tuple[SaveHandle, BaseException] | None = None
        self._lock = threading.Lock()

    def start(self, handle: SaveHandle, job: SaveJob) -> None:
        with self._lock:
            self.handle, self.job = handle, job

    def busy(self) -> bool:
        return self.handle is not None and not self.handle.done()

    def pinned(self) -> set[str]:
        """Chunks the save in flight wrote or reuses: garbage collection must spare them. A save
        that ended pins nothing: committed, its manifest references its chunks (the liveness
        owner keeps them for as long as it exists); failed, they are garbage. (It pinned the
        last step's chunks for good, so a clean close that emptied the memory tier left them.)"""
        with self._lock:
            handle, job = self.handle, self.job
        if job is None or (handle is not None and handle.done()):
            return set()
        return job.pinned_hashes

    def staging(self) -> bool:
        """Whether the save in flight is still staging (the optimizer hook would wait)."""
        handle = self.handle
        return handle is not None and not handle.staged.done()

    def wait_staged(self) -> None:
        """For the optimizer pre-step hook: wait for staging, count it as blocking time on the
        save's handle, never raise (a failure surfaces on the handle, next save, or close)."""
        handle = self.handle
        if handle is None or handle.staged.done():
            return
        t0 = time.perf_counter()
        settle(handle.staged)
        handle.add_blocking(time.perf_counter() - t0)

    def wait_durable(self) -> None:
        """Wait for the save in flight to end, successful or not (errors: ``raise_pending``)."""
        handle = self.handle
        if handle is not None:
            settle(handle.durable)

    def wait_durable_for(self, timeout_s: float) -> bool:
        """Like :meth:`wait_durable`, giving up after ``timeout_s``; True when it ended."""
        handle = self.handle
        if handle is None:
            return True
        try:
            settle(handle.durable, timeout_s)
        except FutureTimeout:
            return False
        return True

    def failed(self, handle: SaveHandle, exc: BaseException) -> None:
        with self._lock:
            self._error = self._error or (handle, as_save_error(exc, handle.step))

    def raise_pending(self) -> None:
        """Raise the first background error unless its handle already delivered it."""
        with self._lock:
            pending, self._error = self._error, None
        if pending is not None and not pending[0].error_delivered:
            pending[0].delivered = True
            raise pending[1]
