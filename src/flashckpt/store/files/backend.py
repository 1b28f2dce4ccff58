"""Backends: where checkpoint bytes rest. Synchronous, no threads.

A backend stores opaque files under relative, ``/``-separated paths that the store builds from
validated parts only (``steps/<step>.json``, ``chunks/ab/<hash>``); the backend validates them
again so no path can escape its root.
"""

from __future__ import annotations

import builtins
import errno
import fcntl
import itertools
import mmap
import os
import stat
import threading
from collections.abc import Sequence
from contextlib import suppress as contextlib_suppress
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from flashckpt.errors import ConfigError, StorageError
from flashckpt.store.files import safeopen
from flashckpt.store.files.directio import write_parts
from flashckpt.store.files.safeopen import check_relpath

Buffer = Any  # bytes, bytearray, memoryview, or a C-contiguous numpy array

_tmp_counter = itertools.count()

FREE_DIR = "staging/free"
"""A memory tier's recycled chunk files (:meth:`LocalBackend.recycle`), named
``<size>-<pid>-<n>.free``."""


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

    Reading: ``read(path)`` returns all bytes, ``read_into(path, out)`` fills ``out`` and returns
    the byte count. A backend whose files live in memory may also offer ``in_memory = True``
    and ``map(path)`` (see :meth:`LocalBackend.map`); readers look for them with ``getattr``.
    ``delete(path)`` removes a file (missing is fine). Errors are raised as
    :class:`~flashckpt.errors.StorageError` naming the path; a missing file on read raises
    ``FileNotFoundError`` so the store can tell damage from unavailability.
    """

    url: str
    is_local: bool

    def put(self, path: str, parts: Sequence[Buffer]) -> int: ...
    def read(self, path: str) -> bytes: ...
    def read_into(self, path: str, out: memoryview) -> int: ...
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
        self._free_bytes: int | None = None  # bytes in FREE_DIR (None: not counted yet)
        self._free_lock = threading.Lock()
        self._stats_lock = threading.Lock()  # put() runs in several persist workers at once
        if self.root.exists() and not self.root.is_dir():
            raise ConfigError(f"checkpoint root {self.root} exists and is not a directory")
        if create:
            try:
                self.root.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise StorageError(f"cannot create checkpoint root {self.root}: {exc}") from exc

    def _abs(self, path: str) -> Path:
        return self.root / check_relpath(path)

    def put(self, path: str, parts: Sequence[Buffer]) -> int:
        head, _, name = check_relpath(path).rpartition("/")
        tmp = f"{name}.tmp-{os.getpid()}-{next(_tmp_counter)}"
        try:
            dfd = safeopen.open_dir(self.root, head, create=True)
        except StorageError:
            raise
        except OSError as exc:
            raise _storage_error("write", self._abs(path), exc) from exc
        try:
            fd = os.open(
                tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644, dir_fd=dfd
            )
            try:
                res = write_parts(fd, parts, direct=self.direct_io)
                with self._stats_lock:
                    if res.direct_refused:
                        self.direct_io = False  # this filesystem has no O_DIRECT
                    self.direct_bytes += res.direct_bytes
                written = res.written
                if self.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            safeopen.replace_in(dfd, tmp, name)  # replaces a planted link, never follows it
        except OSError as exc:
            _unlink_quiet(dfd, tmp)
            raise _storage_error("write", self._abs(path), exc) from exc
        finally:
            os.close(dfd)
        return written

    def open_staged(self, head: str, size: int | None = None) -> StagedFile:
        """A new temporary file in the directory ``head`` (created if missing), to be filled
        with :meth:`StagedFile.write` and then either published under its final name, which
        may be in another directory of this backend (:meth:`StagedFile.publish`), or dropped
        (:meth:`StagedFile.abort`). The save path writes a chunk this way when its name (the
        hash of its bytes) is known only once its bytes are written: one pass over them.
        With ``size``, a recycled file of exactly that size is taken when the pool has one
        (:meth:`recycle`): its pages are resident already, and the bytes are copied into them
        at memory speed instead of being allocated page by page."""
        try:
            dfd = safeopen.open_dir(self.root, head, create=True)
        except StorageError:
            raise
        except OSError as exc:
            raise _storage_error("write", self._abs(head), exc) from exc
        name = f"staged.tmp-{os.getpid()}-{next(_tmp_counter)}"
        try:
            fd = self._take_free(size, dfd, name) if size else None
            if fd is not None:
                return StagedFile(self, dfd, fd, head, name, mapped_size=size)
            fd = os.open(
                name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644, dir_fd=dfd
            )
        except OSError as exc:
            os.close(dfd)
            raise _storage_error("write", self._abs(f"{head}/{name}"), exc) from exc
        return StagedFile(self, dfd, fd, head, name)

    # -- the recycling pool (a memory tier's freed chunk files) ------------------------------
    def recycle(self, path: str) -> int:
        """Instead of deleting the chunk file ``path``, keep its pages for a later staged write
        of the same size: it is moved, under no name a reader looks for, into
        :data:`FREE_DIR` while the pool holds less than ``recycle_bytes``. Returns its size, or
        -1 when it was not kept (the caller deletes it). Only for files on a memory filesystem,
        which allocates every new page one by one (on the 2-core CI VM: 256 MiB written into a
        new tmpfs file 113 ms, copied into a recycled one 25 ms, a memcpy 23 ms). A recycled
        file is reused only once nobody else has it open (a write lease): a reader that opened
        the chunk before gc moved it keeps its bytes, and after the move nobody finds it."""
        if self.recycle_bytes <= 0 or not self.in_memory:
            return -1
        head, _, name = check_relpath(path).rpartition("/")
        with self._free_lock:
            try:
                src = safeopen.open_dir(self.root, head)
            except (OSError, StorageError):
                return -1
            try:
                st = os.stat(name, dir_fd=src, follow_symlinks=False)
                used = self._free_count()
                if (
                    not stat.S_ISREG(st.st_mode)
                    or st.st_nlink != 1
                    or st.st_uid != os.getuid()
                    or st.st_size == 0
                    or used + st.st_size > self.recycle_bytes
                ):
                    return -1
                dst = safeopen.open_dir(self.root, FREE_DIR, create=True)
                try:
                    free = f"{st.st_size}-{os.getpid()}-{next(_tmp_counter)}.free"
                    os.rename(name, free, src_dir_fd=src, dst_dir_fd=dst)
                finally:
                    os.close(dst)
            except (OSError, StorageError):
                return -1
            finally:
                os.close(src)
            self._free_bytes = used + st.st_size
            return int(st.st_size)

    def drain_free(self) -> int:
        """Delete every recycled file (a clean close leaves none); the bytes freed."""
        freed = 0
        with self._free_lock:
            for name in self._names(FREE_DIR):
                try:
                    freed += self.size(f"{FREE_DIR}/{name}")
                except OSError:
                    pass
                self.delete(f"{FREE_DIR}/{name}")
            self._free_bytes = 0
        return freed

    def _free_count(self) -> int:
        if self._free_bytes is None:  # a killed writer's pool is this one's now
            total = 0
            for name in self._names(FREE_DIR):
                try:
                    total += self.size(f"{FREE_DIR}/{name}")
                except OSError:
                    pass
            self._free_bytes = total
        return self._free_bytes

    def _take_free(self, size: int, dfd: int, name: str) -> int | None:
        """A recycled file of exactly ``size`` bytes, renamed to ``name`` in ``dfd`` and
        opened for writing under a write lease (nobody else has it open), or None."""
        with self._free_lock:
            if not self._free_count():
                return None
            prefix = f"{size}-"
            for free in self._names(FREE_DIR):
                if not free.startswith(prefix):
                    continue
                try:
                    src = safeopen.open_dir(self.root, FREE_DIR)
                except (OSError, StorageError):
                    return None
                try:
                    os.rename(free, name, src_dir_fd=src, dst_dir_fd=dfd)
                except OSError:
                    continue  # taken meanwhile
                finally:
                    os.close(src)
                self._free_bytes = max(0, (self._free_bytes or 0) - size)
                fd = _open_recycled(dfd, name, size)
                if fd is not None:
                    return fd
                _unlink_quiet(dfd, name)  # not ours to reuse after all: it goes
        return None

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
        if self.fsync:
            for p in sorted(parents):
                self._sync_dir(p)

    def _open_read(self, path: str) -> int:
        try:
            return safeopen.open_nofollow(self.root, path, os.O_RDONLY)
        except (FileNotFoundError, StorageError):
            raise
        except OSError as exc:
            raise _storage_error("read", self._abs(path), exc) from exc

    def read(self, path: str) -> bytes:
        fd = self._open_read(path)
        try:
            chunks = []
            while got := os.read(fd, 1 << 24):
                chunks.append(got)
            return b"".join(chunks)
        except OSError as exc:
            raise _storage_error("read", self._abs(path), exc) from exc
        finally:
            os.close(fd)

    def read_into(self, path: str, out: memoryview) -> int:
        """Fill ``out`` from the start of the file with large reads (the kernel is told the
        file is read sequentially, which widens its readahead); returns the bytes read, fewer
        than ``len(out)`` when the file is shorter."""
        fd = self._open_read(path)
        try:
            _advise_sequential(fd)
            n = 0
            while n < len(out):
                got = os.readv(fd, [out[n : n + READ_PIECE]])
                if not got:
                    break
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
            size = os.fstat(fd).st_size
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
        safeopen.unlink_nofollow(self.root, path)

    def sync_dirs(self, dirs: Sequence[str]) -> None:
        if not self.fsync:
            return
        for d in sorted(set(dirs)):
            self._sync_dir(d)

    def _sync_dir(self, d: str) -> None:
        rel = "" if d in ("", ".") else d
        try:
            fd = safeopen.open_dir(self.root, rel)
        except FileNotFoundError:
            return
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
            os.close(fd)


READ_PIECE = 64 << 20  # bytes per read() call: large enough that syscalls cost nothing
MEMORY_FILESYSTEMS = frozenset({"tmpfs", "ramfs"})


def _advise_sequential(fd: int) -> None:
    advise = getattr(os, "posix_fadvise", None)
    if advise is not None:
        try:
            advise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        except OSError:
            pass  # advice only


def filesystem_type(path: str | os.PathLike[str]) -> str:
    """The type of the filesystem holding ``path`` ("tmpfs", "ext4", ...; "" when unknown),
    from the longest mount point above it in /proc/self/mountinfo (Linux)."""
    real = os.path.realpath(path)
    best, kind = "", ""
    try:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                left, _, right = line.partition(" - ")
                fields, rest = left.split(), right.split()
                if len(fields) < 5 or not rest:
                    continue
                mount = fields[4].replace("\\040", " ")
                inside = real == mount or real.startswith(mount.rstrip("/") + "/")
                if inside and len(mount) >= len(best):
                    best, kind = mount, rest[0]
    except OSError:
        return ""
    return kind


class StagedFile:
    """A temporary file of a :class:`LocalBackend` being filled (:meth:`LocalBackend.open_staged`).
    A recycled file (``mapped_size``) is filled through a shared mapping of its resident pages.
    Not thread-safe: one writer."""

    def __init__(
        self,
        backend: LocalBackend,
        dfd: int,
        fd: int,
        head: str,
        name: str,
        *,
        mapped_size: int | None = None,
    ) -> None:
        self.backend, self._dfd, self._fd, self.head, self.name = backend, dfd, fd, head, name
        self.written = 0
        self._map: mmap.mmap | None = None
        self._dst: Any = None
        if mapped_size:
            import numpy as np

            try:
                # MAP_POPULATE: the page tables at once (the pages are resident), not a
                # fault per page on the first write into each
                flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
                self._map = mmap.mmap(fd, mapped_size, flags=flags)
            except (OSError, ValueError):
                self.abort()
                raise
            self._dst = np.frombuffer(self._map, dtype=np.uint8)

    @property
    def recycled(self) -> bool:
        return self._map is not None

    def view(self) -> Any:
        """What was written so far into a recycled file's mapping (a numpy view, no copy)."""
        if self._dst is None:
            raise StorageError(f"{self.name} is not a mapped recycled file (internal)")
        return self._dst[: self.written]

    def write(self, buf: Buffer) -> None:
        mv = memoryview(buf).cast("B")
        try:
            if self._dst is not None:
                import numpy as np

                end = self.written + len(mv)
                if end > len(self._dst):
                    raise OSError(errno.EFBIG, "more bytes than the recycled file holds")
                # numpy's copy releases the GIL (the training thread keeps running)
                np.copyto(self._dst[self.written : end], np.frombuffer(mv, dtype=np.uint8))
                self.written = end
                return
            while len(mv):
                n = os.write(self._fd, mv)
                self.written += n
                mv = mv[n:]
        except OSError as exc:
            self.abort()
            where = self.backend._abs(f"{self.head}/{self.name}")
            raise _storage_error("write", where, exc) from exc

    def publish(self, path: str) -> int:
        """Make the file ``path`` (fsynced first when the backend fsyncs; its directory is
        made durable by the caller's ``sync_dirs``); returns its size. A file already at
        ``path`` is replaced, a link there is replaced and never followed."""
        head, _, name = check_relpath(path).rpartition("/")
        try:
            self._unmap()
            if self.backend.fsync:
                os.fsync(self._fd)
            os.close(self._fd)
            self._fd = -1
            dst = safeopen.open_dir(self.backend.root, head, create=True)
            try:
                os.replace(self.name, name, src_dir_fd=self._dfd, dst_dir_fd=dst)
            finally:
                os.close(dst)
        except BaseException as exc:
            self.abort()
            if isinstance(exc, OSError) and not isinstance(exc, StorageError):
                raise _storage_error("write", self.backend._abs(path), exc) from exc
            raise
        self._close_dir()
        return self.written

    def abort(self) -> None:
        """Drop the file (idempotent; also after a failed write or publish)."""
        self._unmap()
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        if self._dfd >= 0:
            _unlink_quiet(self._dfd, self.name)
            self._close_dir()

    def _unmap(self) -> None:
        if self._map is not None:
            self._dst = None
            self._map.close()
            self._map = None
            with contextlib_suppress(OSError):
                fcntl.fcntl(self._fd, fcntl.F_SETLEASE, fcntl.F_UNLCK)

    def _close_dir(self) -> None:
        if self._dfd >= 0:
            os.close(self._dfd)
            self._dfd = -1


def _open_recycled(dfd: int, name: str, size: int) -> int | None:
    """Open the recycled file ``name`` for writing when it is still this user's regular file
    of ``size`` bytes with one link, and a write lease shows nobody else has it open."""
    try:
        fd = os.open(name, os.O_RDWR | os.O_NOFOLLOW, dir_fd=dfd)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        ok = (
            stat.S_ISREG(st.st_mode)
            and st.st_size == size
            and st.st_nlink == 1
            and st.st_uid == os.getuid()
        )
        if ok:
            fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_WRLCK)  # EAGAIN: someone has it open
            return fd
    except OSError:
        pass
    os.close(fd)
    return None


def _unlink_quiet(dfd: int, name: str) -> None:
    try:
        os.unlink(name, dir_fd=dfd)
    except OSError:
        pass


def _storage_error(op: str, path: Path, exc: OSError) -> StorageError:
    hint = ""
    if exc.errno == errno.ENOSPC:
        hint = "; the device is full: free space or point the checkpoint root elsewhere"
    elif exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        hint = "; check permissions on the checkpoint root"
    err = StorageError(f"could not {op} {path}: {exc.strerror or exc}{hint}")
    err.errno = exc.errno
    return err
