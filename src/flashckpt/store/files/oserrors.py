"""OS errors of the storage layer: which ones are the device failing, and how one is reported.

:func:`is_failure` is the one rule for telling an unreadable checkpoint (the device failed:
EIO, a timeout, a stale handle; the bytes may be intact) from a damaged one (missing,
truncated, a symlink or FIFO in its place), which a later save may replace. Restore's chunk
check uses it; :func:`storage_error` turns an ``OSError`` into the
:class:`~flashckpt.errors.StorageError` every backend raises, with a hint for the errnos a
user can act on.
"""

from __future__ import annotations

import errno
from pathlib import Path

from flashckpt.errors import StorageError

# errnos that say the filesystem or device failed, not that what sits at the path is wrong: a
# reader that meets one cannot tell anything about the bytes (they may be intact)
_FAILURES = frozenset(
    getattr(errno, n)
    for n in ("EIO", "EAGAIN", "EBUSY", "EINTR", "ENOMEM", "ETIMEDOUT", "ESTALE", "ENOLINK")
    if hasattr(errno, n)
)


def is_failure(exc: BaseException) -> bool:
    """True when ``exc`` is the filesystem failing (EIO, a timeout, a stale handle...), as
    opposed to evidence about the file (missing, truncated, a symlink or FIFO in its place):
    the one rule for telling an unreadable checkpoint from a damaged one, which a later save
    may replace."""
    return isinstance(exc, OSError) and exc.errno in _FAILURES


def storage_error(op: str, path: Path, exc: OSError) -> StorageError:
    hint = ""
    if exc.errno == errno.ENOSPC:
        hint = "; the device is full: free space or point the checkpoint root elsewhere"
    elif exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        hint = "; check permissions on the checkpoint root"
    err = StorageError(f"could not {op} {path}: {exc.strerror or exc}{hint}")
    err.errno = exc.errno
    return err
