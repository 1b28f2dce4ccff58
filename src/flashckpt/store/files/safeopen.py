"""Opening files inside a checkpoint root (or tier) without ever leaving it.

The one place that turns ``(base, "a/b/name")`` into a file descriptor. ``base`` is the root the
user chose (it may itself be a symlink they made); nothing *below* it is followed: each
directory component is opened with ``O_NOFOLLOW | O_DIRECTORY`` relative to the previous one
(``openat``), and the file itself with ``O_NOFOLLOW``. A symlink anywhere under the root is
refused with a :class:`~flashckpt.errors.StorageError`, so a planted link can never make
flashckpt write, truncate or delete a file elsewhere.

Reads also open with ``O_NONBLOCK`` and check ``fstat``: a FIFO, socket or device in place of a
manifest or chunk is damage (:class:`~flashckpt.errors.CorruptCheckpointError`), never read,
so it cannot hang a restore.

Everything that opens a file under a root goes through here: the local backend, the journal,
the run marker, tiers.json, the root id, and the writer lock.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import os
import stat
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from flashckpt.errors import ConfigError, CorruptCheckpointError, FlashCkptError, StorageError

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_KINDS = {
    stat.S_IFIFO: "FIFO",
    stat.S_IFSOCK: "socket",
    stat.S_IFCHR: "character device",
    stat.S_IFBLK: "block device",
    stat.S_IFDIR: "directory",
    stat.S_IFLNK: "symlink",
}
MAX_READ_BYTES = 1 << 30
F = TypeVar("F", bound=Callable[..., Any])
_inside = threading.local()


def in_gateway() -> bool:
    """True while this thread runs a gateway function: the audit-hook test
    (tests/hostile/test_gateway_audit.py) fails on any file event under a root, a tier or a
    memory tier raised outside one."""
    return getattr(_inside, "depth", 0) > 0


def _gateway(fn: F) -> F:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        _inside.depth = getattr(_inside, "depth", 0) + 1
        try:
            return fn(*args, **kwargs)
        finally:
            _inside.depth -= 1

    return wrapper  # type: ignore[return-value]


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


def kind_of(mode: int) -> str:
    return _KINDS.get(stat.S_IFMT(mode), "special file")


def _refused(path: Path, exc: OSError) -> StorageError:
    err = StorageError(
        f"refusing to open {path}: a component is a symlink or not a directory "
        f"({exc.strerror}); flashckpt never follows links inside a checkpoint root. Remove it "
        "(and check who else can write this directory)"
    )
    err.errno = exc.errno
    return err


def untrusted_dir(st: os.stat_result) -> str | None:
    """Why a directory below a trusted anchor (``st``: its fstat) cannot be trusted: owned by
    someone other than this user or root, or writable by others without the sticky bit (then
    anyone could swap what is inside it). None when it can."""
    if st.st_uid not in (os.geteuid(), 0):
        return f"owned by uid {st.st_uid}, not by this user (uid {os.geteuid()}) or root"
    if st.st_mode & stat.S_IWOTH and not st.st_mode & stat.S_ISVTX:
        return f"writable by others without the sticky bit (mode {stat.S_IMODE(st.st_mode):o})"
    return None


@_gateway
def make_anchor(path: str | os.PathLike[str], *, mode: int = 0o777) -> None:
    """Create the directory ``path`` the user named as a root (an anchor: trusted as given,
    its missing parents created as ``mkdir -p`` does). Everything below it goes through
    :func:`open_dir`."""
    Path(path).mkdir(mode=mode, parents=True, exist_ok=True)


@_gateway
def open_dir(
    base: str | os.PathLike[str],
    rel: str = "",
    *,
    create: bool = False,
    mode: int = 0o755,
    write: bool = False,
) -> int:
    """A directory fd for ``base/rel``. ``base`` is the trusted anchor (the root as the user
    gave it, or /dev/shm itself); below it, every component is opened without following a
    symlink. To create or write anything below it (``create`` or ``write``), every component
    must also be trustworthy (:func:`untrusted_dir`: this user's or root's, not writable by
    others unless sticky); reading another user's root stays possible. With ``create``,
    missing components are created (``mode`` less the umask). Missing: FileNotFoundError."""
    base = Path(base)
    fd = os.open(base, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        done = []
        for part in check_relpath(rel).split("/") if rel else []:
            done.append(part)
            nfd = open_child(fd, part, base, "/".join(done), create=create, mode=mode, write=write)
            os.close(fd)
            fd = nfd
    except OSError as exc:
        os.close(fd)
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise _refused(base / rel, exc) from None
        raise
    return fd


@_gateway
def open_child(
    fd: int,
    part: str,
    base: Path,
    rel: str,
    *,
    create: bool = False,
    mode: int = 0o755,
    write: bool = False,
) -> int:
    """One step of :func:`open_dir`: the directory ``part`` below the directory fd ``fd``
    (``base/rel``: its path, for errors), with the same rules; for callers that keep ``fd``
    open (store/files/removal.py) instead of walking down from the anchor again."""
    try:
        try:
            nfd = os.open(part, _DIR_FLAGS, dir_fd=fd)
        except FileNotFoundError:
            if not create:
                raise
            with contextlib.suppress(FileExistsError):
                os.mkdir(part, mode, dir_fd=fd)
            nfd = os.open(part, _DIR_FLAGS, dir_fd=fd)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise _refused(base / rel, exc) from None
        raise
    try:
        problem = untrusted_dir(os.fstat(nfd)) if create or write else None
    except OSError:
        os.close(nfd)
        raise
    if problem:
        os.close(nfd)
        raise StorageError(
            f"refusing {base / rel}: {problem}; whoever can write it could swap what flashckpt "
            "writes below it. Fix its owner or mode, or choose another path"
        )
    return nfd


@_gateway
def open_nofollow(
    base: str | os.PathLike[str],
    rel: str,
    flags: int,
    mode: int = 0o644,
    *,
    create_dirs: bool = False,
) -> int:
    """An fd for the regular file ``base/rel`` opened with ``flags``; no symlink below ``base``
    is followed, and anything but a regular file is refused (never read, never truncated)."""
    head, _, name = check_relpath(rel).rpartition("/")
    trunc = bool(flags & os.O_TRUNC)
    flags &= ~os.O_TRUNC
    writing = bool(flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT))
    dfd = open_dir(base, head, create=create_dirs, write=writing)
    try:
        fd = os.open(name, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, mode, dir_fd=dfd)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENXIO, errno.EISDIR):
            raise _not_regular(Path(base) / rel, exc) from None
        raise
    finally:
        os.close(dfd)
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise CorruptCheckpointError(
            f"{Path(base) / rel} is a {kind_of(st.st_mode)}, not a regular file; flashckpt "
            "treats it as damage and does not read it (remove it)"
        )
    if writing and st.st_nlink > 1:
        os.close(fd)
        raise StorageError(
            f"refusing to write {Path(base) / rel}: it has {st.st_nlink} links (another name, "
            "maybe outside the root, for the same file); flashckpt never writes through a hard "
            "link. Remove it (and check who else can write this directory)"
        )
    if trunc:
        os.ftruncate(fd, 0)  # only now: a refused file was never truncated
    return fd


def _not_regular(path: Path, exc: OSError) -> CorruptCheckpointError:
    what = {errno.ELOOP: "a symlink", errno.ENXIO: "a FIFO or socket", errno.EISDIR: "a directory"}
    return CorruptCheckpointError(
        f"{path} is {what.get(exc.errno or 0, 'not a regular file')}; flashckpt never follows "
        "or reads it (remove it)"
    )


@_gateway
def read_file(base: str | os.PathLike[str], rel: str, *, max_bytes: int = MAX_READ_BYTES) -> bytes:
    """All bytes of the regular file ``base/rel`` (at most ``max_bytes``, else damage)."""
    fd = open_nofollow(base, rel, os.O_RDONLY)
    try:
        return read_fd(fd, max_bytes=max_bytes, where=Path(base) / rel)
    finally:
        os.close(fd)


@_gateway
def read_fd(
    fd: int,
    *,
    max_bytes: int,
    where: str | os.PathLike[str],
    error: type[FlashCkptError] = CorruptCheckpointError,
) -> bytes:
    """All bytes of the open regular file ``fd``, bounded *before* anything is read: its size
    (``fstat``: a sparse file counts at its apparent size) must be at most ``max_bytes``; a
    file that grows while it is read is cut off at ``max_bytes + 1`` bytes and refused."""
    size = os.fstat(fd).st_size
    if size > max_bytes:
        raise _too_big(where, size, max_bytes, error)
    chunks, total = [], 0
    want = max(size, 1 << 16)
    while total <= max_bytes:
        got = os.read(fd, min(want, max_bytes + 1 - total))
        if not got:
            break
        chunks.append(got)
        total += len(got)
        want = 1 << 16
    if total > max_bytes:
        raise _too_big(where, total, max_bytes, error)
    return b"".join(chunks)


def _too_big(
    where: str | os.PathLike[str], size: int, max_bytes: int, error: type[FlashCkptError]
) -> FlashCkptError:
    return error(
        f"{where} is {size} bytes, more than the {max_bytes} any valid file of this kind "
        "holds; refusing to read it"
    )


@_gateway
def read_path(
    path: str | os.PathLike[str],
    *,
    max_bytes: int,
    what: str = "file",
    error: type[FlashCkptError] = ConfigError,
) -> bytes:
    """All bytes of a file the user named (a config, a pointer, an import source): opened
    non-blocking, refused unless it is a regular file (a FIFO, ``/dev/zero``, ``/dev/urandom``
    or a directory is never read), and its size checked before reading (``max_bytes``).
    Missing: FileNotFoundError. The path itself may be the user's symlink (it is theirs)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except IsADirectoryError:
        raise error(f"{what} {path} is a directory, not a file") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise error(
                f"{what} {path} is a {kind_of(st.st_mode)}, not a regular file; give a file"
            )
        return read_fd(fd, max_bytes=max_bytes, where=f"{what} {path}", error=error)
    finally:
        os.close(fd)


@_gateway
def lstat_in(base: str | os.PathLike[str], rel: str) -> os.stat_result:
    """``lstat`` of ``base/rel`` without following any symlink below ``base``."""
    head, _, name = check_relpath(rel).rpartition("/")
    dfd = open_dir(base, head)
    try:
        return os.stat(name, dir_fd=dfd, follow_symlinks=False)
    finally:
        os.close(dfd)


@_gateway
def list_names(base: str | os.PathLike[str], rel: str) -> list[str]:
    """The names in directory ``base/rel`` (reached without following symlinks), sorted."""
    dfd = open_dir(base, rel)
    try:
        return sorted(os.listdir(dfd))
    finally:
        os.close(dfd)


def is_regular(base: str | os.PathLike[str], rel: str) -> bool:
    """True when ``base/rel`` is a regular file reached without following symlinks."""
    try:
        return stat.S_ISREG(lstat_in(base, rel).st_mode)
    except (OSError, StorageError):
        return False


@_gateway
def rename_into(
    base: str | os.PathLike[str], src: str, dst_dir: str, dst_name: str, *, mode: int = 0o700
) -> None:
    """Move ``base/src`` to ``base/dst_dir/dst_name``; ``dst_dir`` is created (``mode``) if
    missing and, like every component, never followed: a ``quarantine/`` planted as a symlink
    is refused, so damaged files are never moved to wherever it points."""
    head, _, name = check_relpath(src).rpartition("/")
    sfd = open_dir(base, head, write=True)
    try:
        dfd = open_dir(base, dst_dir, create=True, mode=mode)
        try:
            os.rename(name, check_relpath(dst_name), src_dir_fd=sfd, dst_dir_fd=dfd)
        finally:
            os.close(dfd)
    finally:
        os.close(sfd)


@_gateway
def replace_in(dfd: int, src: str, dst: str) -> None:
    os.replace(src, dst, src_dir_fd=dfd, dst_dir_fd=dfd)


@_gateway
def write_file_atomic(
    base: str | os.PathLike[str], rel: str, data: bytes, *, fsync: bool = True, mode: int = 0o644
) -> None:
    """Write ``data`` to ``base/rel`` through a temporary file and an atomic rename, inside a
    directory reached without following symlinks (a link at ``rel`` is replaced, not followed)."""
    head, _, name = check_relpath(rel).rpartition("/")
    dfd = open_dir(base, head, create=True)
    tmp = f"{name}.tmp-{os.getpid()}-{id(data):x}"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode, dir_fd=dfd)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
        replace_in(dfd, tmp, name)
    except BaseException as exc:
        try:
            os.unlink(tmp, dir_fd=dfd)
        except OSError:
            pass
        if isinstance(exc, OSError) and not isinstance(exc, StorageError):
            raise StorageError(
                f"cannot write {Path(base) / rel}: {exc.strerror or exc}; if it is a directory "
                "or not writable, remove it or fix its permissions"
            ) from None
        raise
    finally:
        os.close(dfd)
