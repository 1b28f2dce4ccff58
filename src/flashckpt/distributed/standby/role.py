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
* ``FLASHCKPT_STANDBY_IDLE=1``: the launcher started it under ``SCHED_IDLE`` (or ``nice 19``);
  the takeover restores normal priority.

An active process (and any process not started by the launcher) has none of them.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from flashckpt.errors import ConfigError

ENV = "FLASHCKPT_STANDBY"
ENV_FD = "FLASHCKPT_STANDBY_FD"
ENV_LOCK = "FLASHCKPT_STANDBY_LOCK"
ENV_IDLE = "FLASHCKPT_STANDBY_IDLE"
ENV_READY_FD = "FLASHCKPT_STANDBY_READY_FD"
ALL = (ENV, ENV_FD, ENV_LOCK, ENV_IDLE, ENV_READY_FD)
EXIT_ORPHANED = 75  # the launcher went away before a takeover (EX_TEMPFAIL)
GO = b"go"


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
