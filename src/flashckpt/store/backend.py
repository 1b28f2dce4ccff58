"""Backends: where checkpoint bytes rest. Synchronous, no threads.

A backend stores opaque files under relative, ``/``-separated paths that the store builds from
validated parts only (``steps/<step>.json``, ``chunks/ab/<hash>``); the backend validates them
again so no path can escape its root.
"""

from __future__ import annotations

import builtins
import errno
import itertools
import os
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from flashckpt.errors import ConfigError, StorageError
from flashckpt.store.directio import write_parts

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

    Reading: ``read(path)`` returns all bytes, ``read_into(path, out)`` fills ``out`` and returns
    the byte count. ``delete(path)`` removes a file (missing is fine). Errors are raised as
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


def check_relpath(path: str) -> str:
    """Refuse anything but a clean relative path made of safe components."""
    parts = path.split("/")
    if (
        not path
        or path.startswith("/")
        or any(p in ("", ".", "..") or "\\" in p or "\x00" in p for p in parts)
    ):
        raise StorageError(f"refusing unsafe storage path {path!r}")
    return path


def is_temp_name(name: str) -> bool:
    return ".tmp-" in name


class LocalBackend:
    """A directory on a local (or shared POSIX) filesystem; also used for the /dev/shm tier.

    ``direct_io=True`` writes the page-aligned bulk of each file with ``O_DIRECT`` (see
    :mod:`flashckpt.store.directio`); the disk tier uses it, the memory tier does not.
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
        dst = self._abs(path)
        tmp = dst.with_name(f"{dst.name}.tmp-{os.getpid()}-{next(_tmp_counter)}")
        try:
            dst.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
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
            os.replace(tmp, dst)
        except OSError as exc:
            _unlink_quiet(tmp)
            raise _storage_error("write", dst, exc) from exc
        return written

    def read(self, path: str) -> bytes:
        p = self._abs(path)
        try:
            return p.read_bytes()
        except FileNotFoundError:
            raise
        except OSError as exc:
            raise _storage_error("read", p, exc) from exc

    def read_into(self, path: str, out: memoryview) -> int:
        p = self._abs(path)
        try:
            with open(p, "rb", buffering=0) as f:
                n = 0
                while n < len(out):
                    got = f.readinto(out[n:])
                    if not got:
                        break
                    n += got
                return n
        except FileNotFoundError:
            raise
        except OSError as exc:
            raise _storage_error("read", p, exc) from exc

    def exists(self, path: str) -> bool:
        return self._abs(path).exists()

    def size(self, path: str) -> int:
        return self._abs(path).stat().st_size

    def list(self, prefix: str) -> list[str]:
        d = self._abs(prefix)
        try:
            return sorted(n for n in os.listdir(d) if not is_temp_name(n))
        except FileNotFoundError:
            return []
        except OSError as exc:
            raise _storage_error("list", d, exc) from exc

    def list_temp(self, prefix: str) -> builtins.list[str]:
        d = self._abs(prefix)
        try:
            return sorted(n for n in os.listdir(d) if is_temp_name(n))
        except FileNotFoundError:
            return []

    def delete(self, path: str) -> None:
        _unlink_quiet(self._abs(path))

    def sync_dirs(self, dirs: Sequence[str]) -> None:
        if not self.fsync:
            return
        for d in sorted(set(dirs)):
            p = self.root if d in ("", ".") else self._abs(d)
            try:
                fd = os.open(p, os.O_RDONLY)
            except FileNotFoundError:
                continue
            except OSError as exc:
                raise _storage_error("sync", p, exc) from exc
            try:
                os.fsync(fd)
            except OSError as exc:
                if exc.errno not in (errno.EINVAL, errno.ENOTSUP):  # e.g. tmpfs dirs
                    raise _storage_error("sync", p, exc) from exc
            finally:
                os.close(fd)


def _unlink_quiet(p: Path) -> None:
    try:
        p.unlink()
    except FileNotFoundError:
        pass
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
