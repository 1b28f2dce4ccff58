"""Preemption: turn SIGTERM (spot / preemptible instances, ``kubectl delete``, Slurm) into a
clean, bounded shutdown that loses nothing.

The signal handler does almost nothing, on purpose: it records the time, sets
``Checkpointer.preempted`` and journals ``preempted``. Saves and promotions already in flight keep
running in their background threads. The rest happens at the next *safe point* of the training
loop, where the state is consistent (never in the middle of ``optimizer.step()``):

* ``should_save(step)`` / ``save(step, state)`` after the signal wait for the in-flight save,
  take the final save if configured, wait for promotions until the grace period ends, close the
  Checkpointer and raise :class:`Preempted` (a ``SystemExit`` with code 0): ``finally`` blocks
  and context managers run and the process exits 0.
* ``emergency_save=None``: no new save starts after the signal. ``True``: ``should_save``
  returns True once so the loop's own ``save(step, state)`` becomes the final save (into the
  fastest tier). A mapping, or a callable returning one: saved at ``should_save``'s step.
* A loop that checks ``if ckpt.preempted: break`` and then calls ``ckpt.close()`` gets the same
  bounded wait without the exception.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable, Mapping
from types import FrameType
from typing import TYPE_CHECKING, Any

from flashckpt.errors import ConfigError, FlashCkptError
from flashckpt.journal import Journal

if TYPE_CHECKING:
    from flashckpt.engine.runtime.facade import Facade

log = logging.getLogger(__name__)

EmergencySave = bool | Mapping[str, Any] | Callable[[], Mapping[str, Any] | None]


class Preempted(SystemExit):
    """Raised at a safe point after SIGTERM once the final save and promotions are done (or the
    grace period ran out). A ``SystemExit`` with code 0: the program exits cleanly."""


class Preemption:
    """Owns the SIGTERM handler of one Checkpointer."""

    def __init__(
        self,
        *,
        grace_period_s: float,
        emergency_save: EmergencySave | None,
        journal: Journal,
        exit_code: int = 0,
    ) -> None:
        if not isinstance(grace_period_s, (int, float)) or grace_period_s <= 0:
            raise ConfigError(f"grace_period_s must be a number > 0, got {grace_period_s!r}")
        if emergency_save is not None and not (
            emergency_save is True
            or callable(emergency_save)
            or isinstance(emergency_save, Mapping)
        ):
            raise ConfigError(
                "emergency_save= takes True (save the state of the next save() call), the state "
                "mapping to save, or a callable returning it"
            )
        self.grace_period_s = float(grace_period_s)
        self.emergency_save = emergency_save
        self.journal = journal
        self.exit_code = exit_code
        self.signal_t: float | None = None  # monotonic time of the signal
        self.last_step: int | None = None  # latest step seen by should_save
        self.finishing = False
        # under torch.distributed, ranks other than 0 follow rank 0's decision (``follow``)
        # instead of acting on their own signal, so that all ranks stop at the same step
        self.follows = False
        self.agreed = False
        self._previous: Any = None
        self._installed = False

    # -- the handler ------------------------------------------------------------------------
    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            raise ConfigError(
                "handle_sigterm=True must be set up from the main thread (Python delivers "
                "signals there); create the Checkpointer in the main thread"
            )
        self._previous = signal.signal(signal.SIGTERM, self._on_signal)
        self._installed = True

    def uninstall(self) -> None:
        if self._installed and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._previous or signal.SIG_DFL)
            self._installed = False

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self.signal_t is not None:
            return
        self.signal_t = time.monotonic()
        self.journal.append("preempted", signal=signum, grace_period_s=self.grace_period_s)
        log.warning(
            "SIGTERM: finishing the in-flight save and promotions within %.0fs, then exiting",
            self.grace_period_s,
        )

    # -- queries --------------------------------------------------------------------------
    @property
    def active(self) -> bool:
        """Signalled (a rank that follows rank 0: rank 0 decided to stop)."""
        return self.signal_t is not None and (self.agreed or not self.follows)

    @property
    def triggered(self) -> bool:
        return self.active and not self.finishing

    def time_left(self) -> float:
        if self.signal_t is None:
            return self.grace_period_s
        return max(0.0, self.grace_period_s - (time.monotonic() - self.signal_t))

    def emergency_state(self) -> Mapping[str, Any] | None:
        es = self.emergency_save
        if es is None or isinstance(es, bool):
            return None
        if isinstance(es, Mapping):
            return es
        return es()

    # -- safe points (called by the Checkpointer) ---------------------------------------------
    def at_should_save(self, ckpt: Facade, step: int) -> bool:
        """True forces a save (``emergency_save=True``); otherwise finishes when signalled."""
        self.last_step = step
        if not self.triggered:
            return False
        if self.emergency_save is True:
            return True
        self.finish(ckpt, step=step, state=None)
        return False  # pragma: no cover - finish raises

    def follow(self, ckpt: Facade, step: int) -> bool:
        """Rank 0 decided to stop at ``step`` (torch.distributed): act as if signalled here."""
        if self.signal_t is None:
            self.signal_t = time.monotonic()
            self.journal.append("preempted", signal=None, source="rank 0")
        self.agreed = True
        return self.at_should_save(ckpt, step)

    def at_save(self, ckpt: Facade, step: int, state: Mapping[str, Any]) -> None:
        """After the signal, ``save()`` becomes the final save (when configured) and exits."""
        if self.triggered:
            final = state if self.emergency_save is not None else None
            self.finish(ckpt, step=step, state=final)

    # -- the shutdown -----------------------------------------------------------------------
    def finish(self, ckpt: Facade, *, step: int | None, state: Mapping[str, Any] | None) -> None:
        """Final save (if any), bounded wait for promotions, close; then raise Preempted."""
        self.finishing = True
        t0 = time.monotonic()
        saved = None
        try:
            saved = self.final_save(ckpt, step=step, state=state)
        finally:
            ckpt.close()
            self.journal.append(
                "preempt_done",
                step=saved,
                seconds=time.monotonic() - t0,
                grace_left_s=self.time_left(),
            )
        raise Preempted(self.exit_code)

    def final_save(
        self, ckpt: Facade, *, step: int | None, state: Mapping[str, Any] | None
    ) -> int | None:
        """Wait for the in-flight save; then save ``state`` (or the emergency state) at
        ``step`` unless that step is already saved. Returns the step saved, or None."""
        self.finishing = True
        ckpt._wait_current()
        step = self.last_step if step is None else step
        if state is None and step is not None and step != ckpt.last_step:
            state = self.emergency_state()
        if state is None or step is None or step == ckpt.last_step:
            return None
        if ckpt.has_step(step):  # committed already (restored, or saved by an earlier run)
            log.info(
                "final save after SIGTERM: step %d is already committed; not saved again", step
            )
            return None
        try:
            handle = ckpt.save(step, state)
            handle.wait(timeout=max(self.time_left(), 1.0))
        except (FlashCkptError, TimeoutError) as exc:
            log.error("final save of step %d after SIGTERM failed: %s", step, exc)
            self.journal.append("save_failed", step=step, error=f"preemption: {exc}")
            return None
        return step
