"""The writer lock: one process (per rank) writes a checkpoint root at a time.

Uses ``flock`` on ``ROOT/locks/<name>.lock``; the kernel drops it when the process dies, so a
crashed writer never leaves a stale lock behind.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from flashckpt.errors import LockedError, StorageError


class WriterLock:
    def __init__(self, root: str | os.PathLike[str], *, name: str = "writer") -> None:
        self.path = Path(root) / "locks" / f"{name}.lock"
        self._fd: int | None = None

    def acquire(self) -> None:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise StorageError(f"cannot create lock file {self.path}: {exc}") from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise LockedError(
                f"checkpoint root {self.path.parent.parent} is being written by another process "
                f"(pid {holder}); wait for it to finish, or give this run its own root"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    @property
    def held(self) -> bool:
        return self._fd is not None
