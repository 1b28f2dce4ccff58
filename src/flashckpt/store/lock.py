"""Locks of a checkpoint root (or tier): the writer lock and the root lock.

Both are POSIX record locks (``lockf``) on files under ``ROOT/locks/``. Unlike ``flock``, a
record lock belongs to the process, not to the open file: a forked child (a DataLoader worker)
does not inherit it, so a killed trainer's workers never keep the root locked, and the kernel
drops it the instant the owning process dies. Record locks do not exclude the same process,
so each lock also keeps a per-process registry.

* :class:`WriterLock` (``locks/writer.lock``, or ``locks/rank-<r>.lock`` per rank): held for a
  Checkpointer's lifetime, so two trainers never write one root (or one rank's share of it).
* :class:`RootLock` (``locks/root.lock``): the ONE protocol between writers and garbage
  collection. Every writer of the root (any rank, any process, a save or a promotion) holds it
  *shared* while it may reference chunks no committed manifest names yet; garbage collection
  takes it *exclusive* and never waits for it: when a writer holds it, gc does nothing and says
  so. Within one process the lock is one file descriptor whose mode follows the process's
  holders (shared while any writer window is open, converted to exclusive for a collection and
  back); the liveness module (:mod:`flashckpt.store.liveness`) keeps the in-process side
  consistent with its mutex.

Any ``lockf`` failure other than "held by another process" (EAGAIN/EACCES) is a
:class:`~flashckpt.errors.StorageError` saying the filesystem lacks POSIX locks.
"""

from __future__ import annotations

import errno
import fcntl
import os
import struct
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from flashckpt.errors import FlashCkptError, LockedError, StorageError
from flashckpt.store.files import safeopen

_held: set[str] = set()
_held_lock = threading.Lock()
_HELD_ERRNOS = (errno.EAGAIN, errno.EACCES)


def try_lockf(fd: int, mode: int, path: Path) -> bool:
    """``lockf(fd, mode)``: True when taken, False when another process holds a conflicting
    lock (only with ``LOCK_NB``). Any other failure means the filesystem has no usable POSIX
    record locks, which flashckpt needs to keep writers and garbage collection apart."""
    try:
        fcntl.lockf(fd, mode)
        return True
    except OSError as exc:
        if exc.errno in _HELD_ERRNOS and mode & fcntl.LOCK_NB:
            return False
        raise StorageError(
            f"cannot lock {path}: {exc.strerror or exc} (errno {exc.errno}); the filesystem "
            "holding this checkpoint root does not support POSIX record locks (lockf), which "
            "flashckpt needs to keep writers and garbage collection apart: put the root on a "
            "local disk or a shared filesystem with locking (NFSv4, Lustre with flock/localflock)"
        ) from exc


def _open_lock_file(path: Path) -> int:
    """``ROOT/locks/<name>.lock``, opened without following a symlink anywhere below ROOT (a
    planted link must not make flashckpt create or lock a file outside the root)."""
    root = path.parent.parent
    try:
        return safeopen.open_nofollow(
            root, f"locks/{path.name}", os.O_RDWR | os.O_CREAT, create_dirs=True
        )
    except (OSError, FlashCkptError) as exc:
        raise StorageError(f"cannot create lock file {path}: {exc}") from exc


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
            fd = _open_lock_file(self.path)
            try:
                taken = try_lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, self.path)
            except BaseException:
                os.close(fd)
                raise
            if not taken:
                holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
                os.close(fd)
                raise self._refuse(f"process (pid {holder})")
            os.ftruncate(fd, 0)
            os.pwrite(fd, str(os.getpid()).encode(), 0)
            self._fd = fd
            _held.add(key)

    def release(self) -> None:
        with _held_lock:
            if self._fd is not None:
                try:
                    fcntl.lockf(self._fd, fcntl.LOCK_UN)
                finally:
                    os.close(self._fd)
                    self._fd = None
                    _held.discard(str(self.path.absolute()))

    @property
    def held(self) -> bool:
        return self._fd is not None


def writer_holder(root: str | os.PathLike[str], *, name: str = "writer") -> int | None:
    """The pid of the process holding the writer lock ``name`` of ``root`` (None: nobody).

    A read-only probe (``F_GETLK``): it creates nothing, takes nothing and never waits, so a warm
    standby (distributed/standby/) can poll it while the active writer lives; the kernel drops the
    lock the instant its owner dies, so None then means the writer is gone. A root or lock file
    that does not exist yet has no holder."""
    try:
        fd = safeopen.open_nofollow(root, f"locks/{name}.lock", os.O_RDONLY)
    except FileNotFoundError:
        return None
    except (OSError, FlashCkptError) as exc:
        raise StorageError(f"cannot probe the writer lock of {root}: {exc}") from exc
    try:
        query = struct.pack("hhqqi", fcntl.F_WRLCK, os.SEEK_SET, 0, 0, 0)  # struct flock
        kind, _, _, _, pid = struct.unpack("hhqqi", fcntl.fcntl(fd, fcntl.F_GETLK, query))
    except OSError as exc:
        raise StorageError(f"cannot probe the writer lock of {root}: {exc}") from exc
    finally:
        os.close(fd)
    return None if kind == fcntl.F_UNLCK else pid


class _RootLockState:
    """The process's one descriptor on a root lock file and what it holds."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.fd: int | None = None
        self.mode: str | None = None  # None, "sh" or "ex"
        self.windows = 0  # writer windows open in this process
        self.cv = threading.Condition()
        self.collecting = False


_roots: dict[str, _RootLockState] = {}
_roots_lock = threading.Lock()


class RootLock:
    """``ROOT/locks/root.lock``: writers shared, garbage collection exclusive (module doc)."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        # one descriptor per file per process: closing any other descriptor of it would drop
        # the process's record locks, so aliases (symlinks) must map to the same state
        path = Path(os.path.realpath(root)) / "locks" / "root.lock"
        with _roots_lock:
            self._st = _roots.setdefault(str(path), _RootLockState(path))

    @property
    def path(self) -> Path:
        return self._st.path

    def hold_shared(self) -> None:
        """A writer window opens: hold the lock shared (waits while another process collects)."""
        st = self._st
        with st.cv:
            if st.mode is None:
                fd = _open_lock_file(st.path)
                try:
                    try_lockf(fd, fcntl.LOCK_SH, st.path)
                except BaseException:
                    os.close(fd)
                    raise
                st.fd, st.mode = fd, "sh"
            st.windows += 1

    def release_shared(self) -> None:
        st = self._st
        with st.cv:
            st.windows = max(0, st.windows - 1)
            if st.windows == 0 and st.mode == "sh":
                self._unlock()

    @contextmanager
    def exclusive(self) -> Iterator[bool]:
        """Try to hold the lock exclusively for a collection; yields False (and holds nothing)
        when a writer in another process holds it. Writers of this process may keep their
        windows open: the caller honours their pins under the liveness mutex."""
        st = self._st
        with st.cv:
            while st.collecting:
                st.cv.wait()
            st.collecting = True
            try:
                got = self._to_exclusive()
            except BaseException:
                st.collecting = False
                st.cv.notify_all()
                raise
        try:
            yield got
        finally:
            with st.cv:
                st.collecting = False
                if got:
                    if st.windows > 0 and st.fd is not None:
                        try_lockf(st.fd, fcntl.LOCK_SH, st.path)  # a downgrade never waits
                        st.mode = "sh"
                    else:
                        self._unlock()
                st.cv.notify_all()

    def _to_exclusive(self) -> bool:
        st = self._st
        opened = st.fd is None
        fd = _open_lock_file(st.path) if st.fd is None else st.fd
        try:
            got = try_lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, st.path)
        except BaseException:
            if opened:
                os.close(fd)
            raise
        if got:
            st.fd, st.mode = fd, "ex"
        elif opened:
            os.close(fd)
        return got

    def _unlock(self) -> None:
        st = self._st
        if st.fd is not None:
            try:
                fcntl.lockf(st.fd, fcntl.LOCK_UN)
            finally:
                os.close(st.fd)
                st.fd, st.mode = None, None
