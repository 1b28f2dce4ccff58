"""Removing many files of a root in one pass: retention's old chunks after every save.

Deleting one file through :func:`unlink_nofollow` walks down from the anchor (an
``open`` per component, a ``close`` each, an ``fstat`` each) and sizing it first walks again.
A save's garbage is a few dozen chunk files spread over ``chunks/<xx>/``, so that was some
thirty system calls per chunk, each one a hand-off of the GIL between the background thread and
a training thread that dispatches many small operations (a save every 10 steps measured 906
``open`` calls per save this way). :func:`remove_files` opens each directory once, from its
parent's fd when the parent is open already, with the same rules (never through a symlink,
every component trustworthy), and then needs one ``stat`` and one ``unlink`` per file.
Synchronous; no threads.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Callable, Sequence
from pathlib import Path

from flashckpt.store.files import safeopen
from flashckpt.store.files.safeopen import check_relpath


class Dirs:
    """Directory fds below ``base`` opened for writing, each once (:meth:`get`); close all with
    :meth:`close`."""

    def __init__(self, base: str | os.PathLike[str]) -> None:
        self.base = Path(base)
        self._fds: dict[str, int] = {}

    def get(self, rel: str) -> int:
        """The fd of ``base/rel`` (FileNotFoundError when missing; StorageError through a
        symlink or an untrustworthy component, like :func:`~.safeopen.open_dir`)."""
        fd = self._fds.get(rel)
        if fd is not None:
            return fd
        if not rel:
            fd = safeopen.open_dir(self.base)  # the anchor, trusted as given
        else:
            head, _, name = rel.rpartition("/")
            fd = safeopen.open_child(self.get(head), name, self.base, rel, write=True)
        self._fds[rel] = fd
        return fd

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


@safeopen._gateway
def unlink_nofollow(base: str | os.PathLike[str], rel: str) -> None:
    """Remove ``base/rel`` (the link itself, if it is one); missing is fine. Never through a
    symlinked directory component (refused with StorageError)."""
    head, _, name = check_relpath(rel).rpartition("/")
    try:
        dfd = safeopen.open_dir(base, head, write=True)
    except FileNotFoundError:
        return
    try:
        os.unlink(name, dir_fd=dfd)
    except (FileNotFoundError, IsADirectoryError):
        pass
    except OSError as exc:
        if exc.errno != errno.EPERM:  # EPERM: a directory on some systems
            raise
    finally:
        os.close(dfd)


@safeopen._gateway
def unlink_quiet(dfd: int, name: str) -> None:
    try:
        os.unlink(name, dir_fd=dfd)
    except OSError:
        pass


Recycler = Callable[[int, str, os.stat_result], int]
"""``recycler(dir_fd, name, st)``: keep the file's pages instead of deleting it (a memory
tier's pool, store/files/staged.py; ``st``: its lstat, already taken); its size, or -1 when
not kept."""


@safeopen._gateway
def remove_files(
    base: str | os.PathLike[str], rels: Sequence[str], *, recycle: Recycler | None = None
) -> list[int]:
    """Remove each regular file ``base/rel`` (or hand it to ``recycle``); for each, its size,
    or -1 when it was not removed: missing, or not a regular file (a symlink, FIFO or directory
    planted at the name is left alone, never followed), or its directory cannot be opened or
    the file cannot be sized. A failing ``unlink`` raises."""
    dirs = Dirs(base)
    out: list[int] = []
    try:
        for rel in rels:
            head, _, name = check_relpath(rel).rpartition("/")
            try:
                dfd = dirs.get(head)
                st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
            except OSError:
                out.append(-1)
                continue
            if not stat.S_ISREG(st.st_mode):
                out.append(-1)
                continue
            kept = recycle(dfd, name, st) if recycle is not None else -1
            if kept >= 0:
                out.append(kept)
                continue
            try:
                os.unlink(name, dir_fd=dfd)
            except FileNotFoundError:
                out.append(-1)
                continue
            out.append(st.st_size)
    finally:
        dirs.close()
    return out
