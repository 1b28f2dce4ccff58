"""Writing a file's bytes, with the page cache bypassed (``O_DIRECT``) where the bytes allow it.

A buffered write first copies every byte into freshly allocated page-cache pages; on the
machines measured in BENCHMARKS.md that kernel copy, not the disk, was most of a checkpoint's
CPU cost (about 1 s of system time per 700 MB written buffered, 0.02 s written with
``O_DIRECT``, and the direct writes finished sooner), and that CPU is taken from training.
Checkpoint chunks are written once and read rarely, so caching them buys nothing.

``O_DIRECT`` needs the memory address, the file offset and the length aligned to the device's
logical block; :data:`ALIGN` (4096) satisfies every common device. Each stretch that starts
aligned in memory and in the file is written directly up to its last whole block; everything
else (unaligned buffers, the tail of a chunk) goes through the page cache on the same file
descriptor, toggling the flag with ``fcntl``. A filesystem that refuses ``O_DIRECT`` (EINVAL)
gets buffered writes, and the caller is told so it stops trying.
"""

from __future__ import annotations

import errno
import fcntl
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

ALIGN = 4096
O_DIRECT: int = getattr(os, "O_DIRECT", 0)  # 0 where the platform has none (macOS)


def aligned(nbytes: int) -> int:
    """``nbytes`` (at least 1) rounded up to a whole number of :data:`ALIGN` blocks."""
    return -(-max(1, nbytes) // ALIGN) * ALIGN


@dataclass
class WriteResult:
    written: int = 0
    direct_bytes: int = 0  # of ``written``, bytes that bypassed the page cache
    direct_refused: bool = False  # the filesystem refused O_DIRECT: stop asking


def write_parts(fd: int, parts: Sequence[Any], *, direct: bool) -> WriteResult:
    """Write the concatenation of ``parts`` (buffers) at the start of the empty file ``fd``."""
    res = WriteResult()
    direct = direct and O_DIRECT != 0
    is_direct = False
    for part in parts:
        mv = memoryview(part).cast("B")
        while len(mv):
            n_direct = _aligned_len(mv, res.written) if direct else 0
            want = n_direct > 0
            if want != is_direct:
                if not _set_direct(fd, want):
                    res.direct_refused, direct, want = True, False, False
                is_direct = want
            if is_direct:
                try:
                    n = os.write(fd, mv[:n_direct])
                except OSError as exc:
                    if exc.errno != errno.EINVAL:
                        raise
                    _set_direct(fd, False)  # alignment the device does not accept
                    res.direct_refused, direct, is_direct = True, False, False
                    continue
                res.direct_bytes += n
            else:
                n = os.write(fd, mv)
            res.written += n
            mv = mv[n:]
    return res


def supported(directory: str | os.PathLike[str]) -> bool:
    """Whether files in ``directory`` accept O_DIRECT (creates and removes a probe file)."""
    if not O_DIRECT:
        return False
    probe = os.path.join(directory, f".direct-probe-{os.getpid()}")
    try:  # O_EXCL|O_NOFOLLOW: a planted link or file at the probe's name is never followed
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    except OSError:
        return False
    try:
        return _set_direct(fd, True)
    finally:
        os.close(fd)
        os.unlink(probe)


def _aligned_len(mv: memoryview, offset: int) -> int:
    """Bytes of ``mv`` that may be written with O_DIRECT at file ``offset`` (0: none)."""
    if offset % ALIGN or len(mv) < ALIGN:
        return 0
    if np.frombuffer(mv, dtype=np.uint8).ctypes.data % ALIGN:
        return 0
    return len(mv) - len(mv) % ALIGN


def _set_direct(fd: int, on: bool) -> bool:
    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    new = flags | O_DIRECT if on else flags & ~O_DIRECT
    if new == flags:
        return True
    try:
        fcntl.fcntl(fd, fcntl.F_SETFL, new)
    except OSError as exc:
        if exc.errno in (errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
            return False
        raise
    return True
