"""SaveHandle: the two futures of one save, and its two clocks."""

from __future__ import annotations

import threading
from concurrent.futures import Future
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
    staged: Future[SaveStats] = field(default_factory=Future)
    durable: Future[SaveStats] = field(default_factory=Future)
    skipped: bool = False
    error_delivered: bool = False
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def blocking_s(self) -> float:
        return self.stats.blocking_s

    @property
    def background_s(self) -> float:
        return self.stats.background_s

    def add_blocking(self, seconds: float) -> None:
        with self._lock:
            self.stats.blocking_s += seconds

    def wait(self, timeout: float | None = None) -> SaveStats:
        """Block until durable; re-raises the save's error (which then counts as delivered and
        is not raised again by the next ``save()`` or ``close()``)."""
        try:
            return self.durable.result(timeout)
        except BaseException:
            self.error_delivered = True
            raise

    def done(self) -> bool:
        return self.durable.done()
