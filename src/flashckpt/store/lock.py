"""The writer lock: one process (per rank) writes a checkpoint root at a time.

A POSIX record lock (``lockf``) on ``ROOT/locks/<name>.lock``. Unlike ``flock``, a record lock
belongs to the process, not to the open file: a forked child (a DataLoader worker) does not
inherit it, so a killed trainer's workers never keep the root locked, and the kernel drops it
the instant the owning process dies. Record locks do not exclude the same process, so this
module also keeps a per-process registry of held roots.
"""

from __future__ import annotations

import fcntl
import os
import threading
from pathlib import Path

from flashckpt.errors import LockedError, StorageError

_held: set[str] = set()
_held_lock = threading.Lock()


class WriterLock:
    def __init__(self, root: str | os.PathLike[str], *, name: str = "writer") -> None:
        self.path = Path(root) / "locks" / f"{name}.lock"
        self._fd: int | None = None

    def _refuse(self, holder: str) -> LockedError:
        return LockedError(
            f"checkpoint root {self.path.parent.parent} is being written by another "
            f"{holder}; wait for it to finish (close() it), or give this run its own root"
        )

    def acquire(self) -> None:
        key = str(self.path.absolute())
        with _held_lock:
            if key in _held:
                raise self._refuse(f"Checkpointer in this process (pid {os.getpid()})")
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            except OSError as exc:
                raise StorageError(f"cannot create lock file {self.path}: {exc}") from exc
            try:
                fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
                os.close(fd)
                raise self._refuse(f"process (pid {holder})") from None
            os.ftruncate(fd, 0)
            os.pwrite(fd, str(os.getpid()).encode(), 0)
            self._fd = fd
            _held.add(key)

    def release(self) -> None:
        with _held_lock:
            if self._fd is not None:
                fcntl.lockf(self._fd, fcntl.LOCK_UN)
                os.close(self._fd)
                self._fd = None
                _held.discard(str(self.path.absolute()))

    @property
    def held(self) -> bool:
        return self._fd is not None
