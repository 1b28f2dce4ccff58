"""The contract between ``flashckpt run`` and a standby copy of the training script.

The launcher starts a standby with these environment variables (documented overrides, set by
the launcher only):

* ``FLASHCKPT_STANDBY=1``: this process is a standby; its Checkpointer opens nothing until it
  takes over.
* ``FLASHCKPT_STANDBY_FD=<n>``: the read end of a pipe from the launcher. The launcher writes one
  line ``go <t>`` when the active process (every active rank) is gone and this standby is to
  take over (``t``: when the launcher saw the death). End of file without it: the launcher is
  gone, the standby exits with :data:`EXIT_ORPHANED`.
* ``FLASHCKPT_STANDBY_LOCK=<name>``: the writer lock of the root this rank's Checkpointer takes
  (``writer`` for one process, ``rank-<r>`` for rank r); the standby waits until no process
  holds it before it opens the root.
* ``FLASHCKPT_STANDBY_READY_FD=<n>`` (optional): the write end of a pipe on which the standby
  writes ``ready`` once it waits (everything built and prewarmed).
* ``FLASHCKPT_STANDBY_IDLE=1``: the launcher started it under ``SCHED_IDLE`` (or ``SCHED_BATCH``);
  the takeover restores normal priority.

An active process (and any process not started by the launcher) has none of them. Every process
the launcher starts, active or standby, gets one more:

* ``FLASHCKPT_RUN_STEPPED_FD=<n>``: the write end of a pipe on which the process writes
  ``stepped`` at the first step its Checkpointer is told of (:func:`say_stepped`). The launcher
  starts the next standby only then, so that a standby's imports and model building never
  compete with a start, a restore or a first step (on the 2-core CI VM they made a takeover's
  first step 3x a normal one).
"""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Mapping
from dataclasses import dataclass

from flashckpt.errors import ConfigError

ENV = "FLASHCKPT_STANDBY"
ENV_FD = "FLASHCKPT_STANDBY_FD"
ENV_LOCK = "FLASHCKPT_STANDBY_LOCK"
ENV_IDLE = "FLASHCKPT_STANDBY_IDLE"
ENV_READY_FD = "FLASHCKPT_STANDBY_READY_FD"
ENV_STEPPED_FD = "FLASHCKPT_RUN_STEPPED_FD"
ALL = (ENV, ENV_FD, ENV_LOCK, ENV_IDLE, ENV_READY_FD)
LAUNCHER = (*ALL, ENV_STEPPED_FD)  # everything a launcher sets (a nested one starts clean)
EXIT_ORPHANED = 75  # the launcher went away before a takeover (EX_TEMPFAIL)
GO = b"go"
STEPPED = b"stepped"


@dataclass(frozen=True, kw_only=True)
class Role:
    """What a standby was told by its launcher."""

    fd: int
    lock_name: str
    idle: bool


def from_env(env: Mapping[str, str] | None = None) -> Role | None:
    """This process's standby role, or None when it is not a standby."""
    env = os.environ if env is None else env
    if env.get(ENV, "") in ("", "0"):
        return None
    try:
        fd = int(env[ENV_FD])
    except (KeyError, ValueError):
        raise ConfigError(
            f"{ENV} is set but {ENV_FD} is not a file descriptor: a standby is started by "
            "`flashckpt run --standby 1 -- ...`; unset FLASHCKPT_STANDBY to run normally"
        ) from None
    return Role(fd=fd, lock_name=env.get(ENV_LOCK) or "writer", idle=env.get(ENV_IDLE) == "1")


def standby_env(*, fd: int, ready_fd: int, lock_name: str, idle: bool) -> dict[str, str]:
    """The variables the launcher adds to a standby's environment."""
    return {
        ENV: "1",
        ENV_FD: str(fd),
        ENV_READY_FD: str(ready_fd),
        ENV_LOCK: lock_name,
        ENV_IDLE: "1" if idle else "0",
    }


def is_standby() -> bool:
    """True in a process the launcher started as a standby that has not taken over yet."""
    return os.environ.get(ENV, "") not in ("", "0")


def became_active() -> None:
    """After the takeover this process is the active one: children it starts (DataLoader
    workers, a nested launcher) must not think they are standbys."""
    for name in ALL:
        os.environ.pop(name, None)


def say_stepped() -> None:
    """Tell the launcher this process reached its first training step (once; nothing when the
    process was not started by ``flashckpt run``). The descriptor is written only while it is
    still a pipe: a script that closed it and opened a file under the same number keeps it."""
    fd = os.environ.pop(ENV_STEPPED_FD, None)
    if fd is None:
        return
    with contextlib.suppress(OSError, ValueError):
        n = int(fd)
        if stat.S_ISFIFO(os.fstat(n).st_mode):
            os.write(n, STEPPED + b"\n")
            os.close(n)
