"""Backends: where checkpoint bytes rest. Synchronous, no threads.

A backend stores opaque files under relative, ``/``-separated paths that the store builds from
validated parts only (``steps/<step>.json``, ``chunks/ab/<hash>``); the backend validates them
again so no path can escape its root.
"""

from __future__ import annotations

import builtins
import errno
import itertools
import mmap
import os
import stat
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from flashckpt.errors import ConfigError, StorageError
from flashckpt.store.files import removal, safeopen
from flashckpt.store.files.directio import write_parts
from flashckpt.store.files.fsinfo import MEMORY_FILESYSTEMS, advise_sequential, filesystem_type
from flashckpt.store.files.limits import read_limit
from flashckpt.store.files.oserrors import storage_error as _storage_error
from flashckpt.store.files.removal import unlink_quiet as _unlink_quiet
from flashckpt.store.files.safeopen import check_relpath
from flashckpt.store.files.staged import FreePool, StagedFile

Buffer = Any  # bytes, bytearray, memoryview, or a C-contiguous numpy array

_tmp_counter = itertools.count()


@runtime_checkable
class Backend(Protocol):
    """The storage contract, in the order the store uses it during one save:

    1. ``exists(path)`` / ``list(prefix)``: the store learns which chunks a tier already holds
       (``list`` once when the store opens, ``exists`` to confirm before reusing a chunk).
    2. ``put(path, parts)``: write the concatenation of ``parts`` durably. When it returns, the
       file is complete and its bytes are on stable storage; a crash before that leaves either
       nothing or a temporary file under a name ``list`` never reports as a chunk or manifest.
       Writing the same content to the same path twice is harmless (idempotent), which makes
       concurrent identical writes from several ranks safe.
    3. ``sync_dirs(dirs)``: make the renames done by ``put`` in those directories durable.
       Called once per commit, after all chunks and before the manifest.
    4. ``put`` of the manifest, then ``sync_dirs`` of its directory: the checkpoint now exists.

    Reading: ``read(path)`` returns all bytes, ``read_into(path, out, each=None)`` fills ``out``
    and returns the byte count, calling ``each(piece)`` on every piece of ``out`` as soon as it
    is filled (the store hashes a chunk while its bytes are still in the CPU cache). A backend
    whose files live in memory may also offer ``in_memory = True`` and ``map(path)`` (see
    :meth:`LocalBackend.map`); readers look for them with ``getattr``. ``delete(path)`` removes
    a file (missing is fine). Errors are raised as :class:`~flashckpt.errors.StorageError`
    naming the path; a missing file on read raises ``FileNotFoundError`` so the store can tell
    damage from unavailability.
    """

    url: str
    is_local: bool

    def put(self, path: str, parts: Sequence[Buffer]) -> int: ...
    def read(self, path: str) -> bytes: ...
    def read_into(
        self, path: str, out: memoryview, *, each: Callable[[memoryview], object] | None = None
    ) -> int: ...
    def exists(self, path: str) -> bool: ...
    def size(self, path: str) -> int: ...
    def list(self, prefix: str) -> list[str]: ...
    def delete(self, path: str) -> None: ...
    def sync_dirs(self, dirs: Sequence[str]) -> None: ...


def is_temp_name(name: str) -> bool:
    return ".tmp-" in name


class LocalBackend:
    """A directory on a local (or shared POSIX) filesystem; also used for the /dev/shm tier.

    ``direct_io=True`` writes the page-aligned bulk of each file with ``O_DIRECT`` (see
    :mod:`flashckpt.store.files.directio`); the disk tier uses it, the memory tier does not.
    """

    is_local = True

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        create: bool = True,
        fsync: bool = True,
        direct_io: bool = False,
    ):
        self.root = Path(root).expanduser().absolute()
        self.url = str(self.root)
        self.fsync = fsync
        self.direct_io = direct_io
        self.direct_bytes = 0  # bytes written past the page cache (read by tests and bench)
        self._in_memory: bool | None = None  # see in_memory
        # the recycling pool (memory tier): see recycle(); 0 bytes allowed = never recycle
        self.recycle_bytes = 0
        self._pool = FreePool(self)
        self._stats_lock = threading.Lock()  # put() runs in several persist workers at once
        self._by_thread = threading.local()  # see last_stat
        if self.root.exists() and not self.root.is_dir():
            raise ConfigError(f"checkpoint root {self.root} exists and is not a directory")
        if create:
            try:
                safeopen.make_anchor(self.root)
            except OSError as exc:
                raise StorageError(f"cannot create checkpoint root {self.root}: {exc}") from exc

    def _abs(self, path: str) -> Path:
        return self.root / check_relpath(path)

    def put(self, path: str, parts: Sequence[Buffer]) -> int:
        """Write ``path`` (a temporary name, fsync, rename); over a recycled file when the pool
        has one, and a full disk gets the pool back (FreePool.open_write, .when_full)."""
        return self._pool.when_full(lambda: self._put(path, parts))

    def _put(self, path: str, parts: Sequence[Buffer]) -> int:
        head, _, name = check_relpath(path).rpartition("/")
        tmp = f"{name}.tmp-{os.getpid()}-{next(_tmp_counter)}"
        try:
            dfd = safeopen.open_dir(self.root, head, create=True)
        except StorageError:
            raise
        except OSError as exc:
            raise _storage_error("write", self._abs(path), exc) from exc
        try:
            fd, recycled = self._pool.open_write(dfd, tmp, head, parts)
            try:
                res = write_parts(fd, parts, direct=self.direct_io)
                with self._stats_lock:
                    if res.direct_refused:
                        self.direct_io = False  # this filesystem has no O_DIRECT
                    self.direct_bytes += res.direct_bytes
                if self.syncs():  # a recycled file's size and blocks are durable already
                    os.fdatasync(fd) if recycled else os.fsync(fd)
                safeopen.replace_in(dfd, tmp, name)  # replaces a planted link, never follows it
                st = os.fstat(fd)
            finally:
                os.close(fd)
        except OSError as exc:
            _unlink_quiet(dfd, tmp)
            raise _storage_error("write", self._abs(path), exc) from exc
        finally:
            os.close(dfd)
        self._by_thread.last = (path, st)
        return res.written

    def last_stat(self, path: str) -> os.stat_result | None:
        """The ``fstat`` of the file that this thread's last :meth:`put` (after the rename) or
        :meth:`map` opened, if that was ``path``: a chunk's stamp (store/liveness.py) without
        walking down from the root again to stat it. None otherwise; answered once."""
        last = getattr(self._by_thread, "last", None)
        self._by_thread.last = None
        return last[1] if last is not None and last[0] == path else None

    def open_staged(self, head: str, size: int | None = None) -> StagedFile:
        """A new temporary file in the directory ``head`` (created if missing), to be filled
        with :meth:`StagedFile.write` and then either published under its final name, which
        may be in another directory of this backend (:meth:`StagedFile.publish`), or dropped
        (:meth:`StagedFile.abort`). The save path writes a chunk this way when its name (the
        hash of its bytes) is known only once its bytes are written: one pass over them.
        With ``size``, a recycled file of that size when the pool has one (:meth:`recycle`):
        its pages are resident, so bytes are copied in at memory speed, not page by page."""
        try:
            dfd = safeopen.open_dir(self.root, head, create=True)
        except StorageError:
            raise
        except OSError as exc:
            raise _storage_error("write", self._abs(head), exc) from exc
        name = f"staged.tmp-{os.getpid()}-{next(_tmp_counter)}"
        try:
            fd = self._pool.take(size, dfd, name, head=head) if size else None
            if fd is not None:
                return StagedFile(self, dfd, fd, head, name, mapped_size=size)
            fd = os.open(
                name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644, dir_fd=dfd
            )
        except OSError as exc:
            os.close(dfd)
            raise _storage_error("write", self._abs(f"{head}/{name}"), exc) from exc
        return StagedFile(self, dfd, fd, head, name)

    # -- the recycling pool (store/files/staged.py) ---------------------------------------
    def recycle(self, path: str) -> int:
        """Keep the chunk file ``path`` for a later write of the same size instead of deleting
        it (:meth:`FreePool.recycle`); its size, or -1 when not kept."""
        return self._pool.recycle(path)

    def remove_files(self, paths: Sequence[str]) -> builtins.list[int]:
        """Delete (or recycle, :meth:`recycle`) each of ``paths``; the size of each,
        -1 when it was not removed (missing, not a regular file, or not sizable). Each
        directory is opened once (store/files/removal.py)."""
        try:
            with self._pool.recycling() as keep:
                return removal.remove_files(self.root, paths, recycle=keep)
        except (FileNotFoundError, StorageError):
            raise
        except OSError as exc:
            raise _storage_error("delete", self.root, exc) from exc

    def drain_free(self) -> int:
        """Delete every recycled file (a clean close leaves none); the bytes freed."""
        return self._pool.drain()

    def make_dirs(self, dirs: Sequence[str]) -> None:
        """Create the directories ``dirs`` (relative; missing parents too) ahead of the writes
        that will need them, and make their entries durable: the parents and ancestors of new
        directories are fsynced once each. Existing directories are left alone; a symlink is
        refused like everywhere (StorageError)."""
        parents: set[str] = set()
        for d in dirs:
            rel = check_relpath(d)
            try:
                fd = safeopen.open_dir(self.root, rel)
            except FileNotFoundError:
                fd = safeopen.open_dir(self.root, rel, create=True)
                parts = rel.split("/")  # any ancestor may be new as well
                parents.update("/".join(parts[:i]) for i in range(len(parts)))
            except StorageError:
                raise
            except OSError as exc:
                raise _storage_error("create", self._abs(rel), exc) from exc
            os.close(fd)
        if self.syncs():
            self._sync_each(sorted(parents))

    def _open_read(self, path: str) -> int:
        try:
            return safeopen.open_nofollow(self.root, path, os.O_RDONLY)
        except (FileNotFoundError, StorageError):
            raise
        except OSError as exc:
            raise _storage_error("read", self._abs(path), exc) from exc

    def read(self, path: str) -> bytes:
        """All bytes of ``path``; a file larger than any valid one of its kind
        (:func:`~flashckpt.store.format.names.read_limit`) is refused as damage before a byte
        of it is read, so a sparse "1 TiB manifest" costs nothing."""
        fd = self._open_read(path)
        try:
            return safeopen.read_fd(fd, max_bytes=read_limit(path), where=self._abs(path))
        except OSError as exc:
            raise _storage_error("read", self._abs(path), exc) from exc
        finally:
            os.close(fd)

    def read_into(
        self, path: str, out: memoryview, *, each: Callable[[memoryview], object] | None = None
    ) -> int:
        """Fill ``out`` from the start of the file with large reads (the kernel is told the
        file is read sequentially, which widens its readahead); returns the bytes read, fewer
        than ``len(out)`` when the file is shorter. With ``each``, the reads are cache-sized
        (``EACH_PIECE``) and ``each`` sees every piece right after it is read."""
        piece = READ_PIECE if each is None else EACH_PIECE
        fd = self._open_read(path)
        try:
            advise_sequential(fd)
            n = 0
            while n < len(out):
                got = os.readv(fd, [out[n : n + piece]])
                if not got:
                    break
                if each is not None:
                    each(out[n : n + got])
                n += got
            return n
        except OSError as exc:
            raise _storage_error("read", self._abs(path), exc) from exc
        finally:
            os.close(fd)

    @property
    def in_memory(self) -> bool:
        """True when the root is on a memory filesystem (tmpfs, ramfs: the memory tier), where
        mapping a file reads it at memory speed and a read() would only add a copy."""
        if self._in_memory is None:
            self._in_memory = filesystem_type(self.root) in MEMORY_FILESYSTEMS
        return self._in_memory

    def map(self, path: str) -> mmap.mmap | None:
        """A private, copy-on-write map of the whole regular file ``path`` (None when it is
        empty). Opened like every read: no symlink below the root is followed, and a FIFO,
        socket, device or directory is refused as damage before anything is mapped. Writing
        to the map never reaches the file. The caller checks the length against what it
        expects before touching the bytes: a file that another process truncates *while* it is
        mapped faults (SIGBUS) on access, as with any mapped reader; flashckpt never truncates
        a chunk (written once under a temporary name, renamed, unlinked)."""
        fd = self._open_read(path)
        try:
            st = os.fstat(fd)
            self._by_thread.last = (path, st)
            size = st.st_size
            if size == 0:
                return None
            return mmap.mmap(fd, size, access=mmap.ACCESS_COPY)
        except (OSError, ValueError) as exc:
            err = exc if isinstance(exc, OSError) else OSError(errno.EINVAL, str(exc))
            raise _storage_error("map", self._abs(path), err) from exc
        finally:
            os.close(fd)

    def exists(self, path: str) -> bool:
        """True for a regular file reached without following a symlink; False when missing or
        anything else (a reader finds that damage); StorageError when the filesystem fails,
        like every other method (an I/O error is not "absent")."""
        try:
            return stat.S_ISREG(safeopen.lstat_in(self.root, path).st_mode)
        except (FileNotFoundError, NotADirectoryError, StorageError):
            return False
        except OSError as exc:
            raise _storage_error("stat", self._abs(path), exc) from exc

    def size(self, path: str) -> int:
        """Size of a regular file; FileNotFoundError when missing, StorageError when it is a
        symlink, FIFO, directory or device (never followed), or when the filesystem fails."""
        try:
            st = safeopen.lstat_in(self.root, path)
        except (FileNotFoundError, StorageError):
            raise
        except OSError as exc:
            raise _storage_error("stat", self._abs(path), exc) from exc
        if not stat.S_ISREG(st.st_mode):
            raise StorageError(
                f"{self._abs(path)} is a {safeopen.kind_of(st.st_mode)}, not a regular file"
            )
        return st.st_size

    def _names(self, prefix: str) -> builtins.list[str]:
        """Entries of ``prefix`` that are not symlinks (a listing never follows a link)."""
        try:
            dfd = safeopen.open_dir(self.root, prefix)
        except FileNotFoundError:
            return []
        except StorageError:
            raise
        except OSError as exc:
            raise _storage_error("list", self._abs(prefix), exc) from exc
        try:
            with os.scandir(dfd) as it:
                return [e.name for e in it if not e.is_symlink()]
        except OSError as exc:
            raise _storage_error("list", self._abs(prefix), exc) from exc
        finally:
            os.close(dfd)

    def list(self, prefix: str) -> builtins.list[str]:
        return sorted(n for n in self._names(prefix) if not is_temp_name(n))

    def list_temp(self, prefix: str) -> builtins.list[str]:
        return sorted(n for n in self._names(prefix) if is_temp_name(n))

    def delete(self, path: str) -> None:
        """Remove a file (a symlink is removed itself, never its target); missing is fine.
        A symlinked directory component is refused (StorageError): nothing outside the root
        is ever deleted."""
        removal.unlink_nofollow(self.root, path)

    def syncs(self) -> bool:
        """Whether an fsync does anything here: not when asked not to, and not on a memory
        filesystem, where it is a no-op that still costs a system call, and in a thread beside
        a training loop a hand-off of the GIL (a memory-tier save made one per chunk)."""
        return self.fsync and not self.in_memory

    def sync_dirs(self, dirs: Sequence[str]) -> None:
        if self.syncs():
            self._sync_each(dirs)

    def _sync_each(self, dirs: Sequence[str]) -> None:
        """fsync each directory (missing ones skipped); parents shared by several are opened
        once (a promotion's commit syncs a directory per chunk: each a walk from the root)."""
        walk = removal.Dirs(self.root)
        try:
            for d in sorted(set(dirs)):
                rel = "" if d in ("", ".") else check_relpath(d)
                try:
                    fd = walk.get(rel)
                except FileNotFoundError:
                    continue
                except StorageError:
                    raise
                except OSError as exc:
                    raise _storage_error("sync", self._abs(d) if rel else self.root, exc) from exc
                try:
                    os.fsync(fd)
                except OSError as exc:
                    if exc.errno not in (errno.EINVAL, errno.ENOTSUP):  # e.g. tmpfs dirs
                        raise _storage_error("sync", self.root / rel, exc) from exc
        finally:
            walk.close()


READ_PIECE = 64 << 20  # bytes per read() call: large enough that syscalls cost nothing
EACH_PIECE = 256 << 10  # bytes per read() when each piece is hashed: stays in the L2 cache
