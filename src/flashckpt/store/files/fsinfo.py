"""What the filesystem under a path is, and advice to it (no file under a root is opened here).

:func:`filesystem_type` tells the memory tier's tmpfs from a disk (a memory filesystem maps a
file at memory speed and makes ``fsync`` a no-op); :func:`advise_sequential` is read-ahead advice.
"""

from __future__ import annotations

import os

MEMORY_FILESYSTEMS = frozenset({"tmpfs", "ramfs"})


def advise_sequential(fd: int) -> None:
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
