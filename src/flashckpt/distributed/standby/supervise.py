"""``flashckpt run``: run a training script with a warm standby and take over when it dies.

The launcher starts the *active* set (``nproc`` ranks of the script) and, with ``standby=1``, a
*standby* set: the same command with the standby variables (:mod:`.role`), each rank on idle CPU
priority, which builds everything and waits inside ``Checkpointer.restore()`` (:mod:`.wait`).
Then it watches both, every few milliseconds:

* every active rank exited 0: the run is done; the standby is ended (SIGKILL: it holds nothing),
  and the launcher exits 0;
* an active rank failed (exit code not 0, or killed): the other active ranks are ended, then the
  standby set is told ``go`` (it restores from the memory tier and continues as the active set)
  and a new standby set is started. Without a live standby, the script is started again cold.
  After ``max_restarts`` restarts the launcher gives up with the failed rank's exit code;
* a standby rank died (before or after it was ready): its set is ended and a new one started
  after a back-off (1, 2, 4 ... s); this never touches the active set. After
  ``max_standby_failures`` failures in a row before any became ready, the launcher stops
  starting standbys (restarts are then cold) and says so;
* SIGTERM / SIGINT to the launcher: forwarded to the active set (its Checkpointer's
  ``handle_sigterm`` may save), the standby is ended, and the launcher exits with the active
  set's code once it is gone.

A standby is started only once the active set reached its first training step (each rank says
so on a pipe, :func:`~.role.say_stepped`; or after :data:`SETTLE_MAX_S`, for a script that
never steps through a Checkpointer or closes the pipe; a pipe closed by a death is not a
step): the standby's imports and model building take CPU and memory bandwidth even at idle
priority, and while the active set starts, restores or runs its first step that is the
restart's time (on the 2-core CI VM a takeover's first step took 3x a normal step with the
next standby starting beside it). So an active set that dies before its first step has no
standby yet and is restarted cold; one that dies after it, before the next standby is ready,
is taken over by that standby as soon as it reaches ``restore()``.

Every process it starts gets ``FLASHCKPT_RUN_GENERATION`` (1, 2, ...: the set it belongs to)
and, with ``nproc > 1``, torchrun's variables (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``: a fresh port per set).

``state_file`` (optional): a JSON object rewritten at every change — ``{"launcher": pid,
"generation": n, "active": [pids], "standby": [pids], "standby_ready": bool, "restarts": n,
"takeovers": n, "cold_restarts": n, "standby_failures": n}`` — for a benchmark or an operator
that needs to know which process is the active one.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from flashckpt.distributed.standby.procs import RankSet, start_set
from flashckpt.errors import ConfigError

log = logging.getLogger(__name__)
POLL_S = 0.005
SETTLE_MAX_S = 30.0  # start the standby after this long even if the active never said stepped


def _exit_code(code: int) -> int:
    return 128 - code if code < 0 else code  # killed by signal n: 128 + n, as a shell says


class Supervisor:
    """Runs ``cmd`` with a warm standby (see the module)."""

    def __init__(
        self,
        cmd: Sequence[str],
        *,
        nproc: int = 1,
        standby: int = 1,
        max_restarts: int = 100,
        max_standby_failures: int = 3,
        state_file: str | os.PathLike[str] | None = None,
        say: Callable[[str], None] = print,
    ) -> None:
        if not cmd:
            raise ConfigError("flashckpt run needs a command after --, e.g. -- python train.py")
        if nproc < 1:
            raise ConfigError(f"--nproc-per-node must be at least 1, got {nproc}")
        if standby not in (0, 1):
            raise ConfigError(f"--standby must be 0 or 1 (one standby set), got {standby}")
        if max_restarts < 0:
            raise ConfigError(f"--max-restarts must be 0 or more, got {max_restarts}")
        self.cmd, self.nproc, self.standby = list(cmd), nproc, standby
        self.max_restarts, self.max_standby_failures = max_restarts, max_standby_failures
        self.state_file = Path(state_file) if state_file else None
        self.say = say
        self.generation = 0
        self.counts = {"restarts": 0, "takeovers": 0, "cold_restarts": 0, "standby_failures": 0}
        self._failures_in_a_row = 0
        self._spare_due = 0.0  # when the next standby set may start (back-off)
        self._stopping: int | None = None  # a signal to pass on
        self._ready_noted = False  # the state file says the current standby is ready
        self.active: RankSet | None = None
        self.spare: RankSet | None = None

    def run(self) -> int:
        previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            self.active = self._start(standby=False)
            self._maybe_spare()
            while True:
                code = self._tick()
                if code is not None:
                    return code
                time.sleep(POLL_S)
        finally:
            for s, h in previous.items():
                signal.signal(s, h)
            for rs in (self.spare, self.active):
                if rs is not None:
                    rs.end()
            self._write_state()

    def _on_signal(self, sig: int, _frame: Any) -> None:
        self._stopping = sig

    def _start(self, *, standby: bool) -> RankSet:
        self.generation += 1
        rs = start_set(self.cmd, generation=self.generation, nproc=self.nproc, standby=standby)
        self._write_state()
        return rs

    def _tick(self) -> int | None:
        """One look at both sets; the launcher's exit code once the run is over."""
        assert self.active is not None
        if self._stopping is not None:
            return self._stop(self._stopping)
        codes = self.active.codes()
        failed = [c for c in codes if c is not None and c != 0]
        if not failed and all(c == 0 for c in codes):
            self.say(f"flashckpt run: the script finished (generation {self.active.generation})")
            return 0
        if failed:
            return self._active_failed(_exit_code(failed[0]))
        self._watch_spare()
        return None

    def _active_failed(self, code: int) -> int | None:
        assert self.active is not None
        seen = time.time()
        self.active.end()
        if self.counts["restarts"] >= self.max_restarts:
            self.say(f"flashckpt run: the script failed (exit {code}); no restarts left")
            return code
        self.counts["restarts"] += 1
        spare, self.spare = self.spare, None
        if spare is not None and all(c is None for c in spare.codes()) and spare.go(seen):
            self.counts["takeovers"] += 1
            self.active = spare
            self.say(
                f"flashckpt run: the script failed (exit {code}); standby generation "
                f"{spare.generation} takes over"
            )
        else:
            if spare is not None:
                spare.end()
            self.counts["cold_restarts"] += 1
            self.say(f"flashckpt run: the script failed (exit {code}); no standby: restarting it")
            self.active = self._start(standby=False)
        self._spare_due = 0.0
        self._maybe_spare()
        self._write_state()
        return None

    def _watch_spare(self) -> None:
        spare = self.spare
        if spare is None:
            self._maybe_spare()
            return
        ready_before = spare.ready()
        dead = [c for c in spare.codes() if c is not None]
        if not dead:
            if ready_before and not self._ready_noted:
                self._ready_noted, self._failures_in_a_row = True, 0
                self._write_state()
            return
        spare.end()
        self.spare = None
        self.counts["standby_failures"] += 1
        if not ready_before:
            self._failures_in_a_row += 1
        backoff = min(30.0, 2.0 ** (self._failures_in_a_row - 1)) if self._failures_in_a_row else 1
        self._spare_due = time.monotonic() + backoff
        self.say(
            f"flashckpt run: the standby (generation {spare.generation}) exited with "
            f"{_exit_code(dead[0])}; the active run is not affected"
            + (
                ""
                if self._failures_in_a_row < self.max_standby_failures
                else f"; {self._failures_in_a_row} failed starts in a row: no more standbys "
                "(restarts will be cold)"
            )
        )
        self._write_state()

    def _maybe_spare(self) -> None:
        if not self.standby or self.spare is not None or time.monotonic() < self._spare_due:
            return
        if not self._settled():
            return
        if self._failures_in_a_row >= self.max_standby_failures:
            return
        self._ready_noted = False
        try:
            self.spare = self._start(standby=True)
        except OSError as exc:  # the active run goes on without one
            self._failures_in_a_row += 1
            self.counts["standby_failures"] += 1
            self._spare_due = time.monotonic() + 1.0
            self.say(f"flashckpt run: cannot start a standby ({exc}); the active run goes on")

    def _settled(self) -> bool:
        """The active set is past its first step (see the module): a standby may start."""
        active = self.active
        if active is None:
            return True
        return active.stepped() or time.time() - active.active_t >= SETTLE_MAX_S

    def _stop(self, sig: int) -> int:
        assert self.active is not None
        if self.spare is not None:
            self.spare.end()
            self.spare = None
        self.active.signal(sig)
        while any(c is None for c in self.active.codes()):
            time.sleep(POLL_S)
        codes = [c for c in self.active.codes() if c]
        return _exit_code(codes[0]) if codes else 0

    def _write_state(self) -> None:
        if self.state_file is None:
            return
        state = {
            "launcher": os.getpid(),
            "generation": self.generation,
            "active": self.active.pids if self.active else [],
            "standby": self.spare.pids if self.spare else [],
            "standby_ready": bool(self.spare and self.spare.ready()),
            **self.counts,
        }
        tmp = self.state_file.with_name(self.state_file.name + ".tmp")
        tmp.write_text(json.dumps(state))
        os.replace(tmp, self.state_file)


def run(cmd: Sequence[str], **options: Any) -> int:
    """Run ``cmd`` under :class:`Supervisor` (``flashckpt run``); returns its exit code."""
    return Supervisor(cmd, **options).run()
