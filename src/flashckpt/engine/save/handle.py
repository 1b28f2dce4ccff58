"""SaveHandle: the two futures of one save, and its two clocks."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

from flashckpt.errors import FlashCkptError, SaveError


def as_save_error(exc: BaseException, step: int) -> BaseException:
    """A background failure as a FlashCkptError (a :class:`SaveError` wrapping the cause)."""
    if isinstance(exc, FlashCkptError) or not isinstance(exc, Exception):
        return exc
    err = SaveError(f"checkpoint step {step} failed: {type(exc).__name__}: {exc}")
    err.__cause__ = exc
    return err


class Outcome(Future[Any]):
    """A save's future that remembers whether the caller has seen its error, and the one
    gateway through which anything waits for a save.

    ``result()`` raising or ``exception()`` returning the error counts as delivered, so the
    next ``save()`` or ``close()`` does not raise it a second time. The engine itself waits
    through :func:`settle` / :func:`failure`, which do not count.

    ``waited_on`` (set by the engine when the save starts: the save threads' priority,
    engine/runtime/priority.py) is entered for as long as a wait on a future not yet done
    lasts, whoever waits: the threads a caller waits for run at full speed meanwhile.
    """

    def __init__(self) -> None:
        super().__init__()
        self.observed = False
        self.waited_on: Callable[[], AbstractContextManager[None]] | None = None

    def waiting(self) -> AbstractContextManager[None]:
        """What a wait on this future runs inside (nothing once it is done)."""
        hook = self.waited_on
        return contextlib.nullcontext() if hook is None or self.done() else hook()

    def result(self, timeout: float | None = None) -> Any:
        try:
            with self.waiting():
                return super().result(timeout)
        except FutureTimeout:
            raise
        except BaseException:
            self.observed = True
            raise

    def exception(self, timeout: float | None = None) -> BaseException | None:
        with self.waiting():
            exc = super().exception(timeout)
        if exc is not None:
            self.observed = True
        return exc


def settle(fut: Future[Any], timeout: float | None = None) -> None:
    """Wait until ``fut`` is done without raising or marking its error delivered."""
    with fut.waiting() if isinstance(fut, Outcome) else contextlib.nullcontext():
        Future.exception(fut, timeout)


def failure(fut: Future[Any]) -> BaseException | None:
    """The error of a done ``fut`` (not counted as delivered)."""
    return Future.exception(fut, 0)


@dataclass(kw_only=True)
class SaveStats:
    """Bytes and times of one save. ``blocking_s`` is time the training thread waited (in
    ``save()`` and in the optimizer pre-step hook); ``background_s`` is time from ``save()`` to
    durable spent in background work."""

    step: int
    blocking_s: float = 0.0
    background_s: float = 0.0
    staged_s: float = 0.0
    total_bytes: int = 0
    new_bytes: int = 0
    reused_bytes: int = 0
    stored_bytes: int = 0
    chunks_new: int = 0
    chunks_reused: int = 0

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)

    def durable_fields(self) -> dict[str, Any]:
        """The ``durable`` journal event's fields (see journal.py)."""
        return {
            "step": self.step,
            "blocking_s": self.blocking_s,
            "background_s": self.background_s,
            "total_bytes": self.total_bytes,
            "new_bytes": self.new_bytes,
            "reused_bytes": self.reused_bytes,
            "chunks_new": self.chunks_new,
            "chunks_reused": self.chunks_reused,
            "throughput_Bps": self.new_bytes / self.background_s if self.background_s else 0.0,
        }


@dataclass(kw_only=True)
class SaveHandle:
    """Returned by :meth:`Checkpointer.save`.

    ``staged`` completes when the snapshot is protected (training may change the state);
    ``durable`` completes when the checkpoint is committed. Both carry the same
    :class:`SaveStats` as result, or the error that stopped the save.
    """

    step: int
    stats: SaveStats
    staged: Future[SaveStats] = field(default_factory=Outcome)
    durable: Future[SaveStats] = field(default_factory=Outcome)
    skipped: bool = False
    delivered: bool = False  # set when save()/wait() raised the error
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @classmethod
    def done_skipped(cls, step: int) -> SaveHandle:
        """The handle of a save skipped (``on_busy="skip"``): both futures already done."""
        handle = cls(step=step, stats=SaveStats(step=step), skipped=True)
        handle.staged.set_result(handle.stats)
        handle.durable.set_result(handle.stats)
        return handle

    @property
    def blocking_s(self) -> float:
        return self.stats.blocking_s

    @property
    def background_s(self) -> float:
        return self.stats.background_s

    def add_blocking(self, seconds: float) -> None:
        with self._lock:
            self.stats.blocking_s += seconds

    @property
    def error_delivered(self) -> bool:
        """True once the caller saw this save's error (``wait()``, ``durable.result()``,
        ``staged.result()``, ``.exception()``, or the ``save()`` that raised it)."""
        return self.delivered or any(
            isinstance(f, Outcome) and f.observed for f in (self.staged, self.durable)
        )

    def wait(self, timeout: float | None = None) -> SaveStats:
        """Block until durable; re-raises the save's error (which then counts as delivered and
        is not raised again by the next ``save()`` or ``close()``)."""
        return self.durable.result(timeout)

    def done(self) -> bool:
        return self.durable.done()

    def waited_on(self, hook: Callable[[], AbstractContextManager[None]]) -> None:
        """Every wait on this save's futures runs inside ``hook()`` (:class:`Outcome`)."""
        for fut in (self.staged, self.durable):
            if isinstance(fut, Outcome):
                fut.waited_on = hook
