"""The staging arena's memory: a file in the memory tier, kept resident across restarts.

Every restart begins with a save, in a new process whose anonymous memory is all new, and a
fresh arena costs its page faults on the first copy into it (on the 2-vCPU CI VM: 0.5-0.9 s to
first copy 512 MiB into new anonymous memory, 0.05 s into resident memory). With a memory tier
on tmpfs the arena is instead a file there, ``<tier>/staging/<lock name>.arena`` (mode 0600),
mapped shared: its pages stay allocated when the process is killed, so the restarted process
maps the same pages (``MAP_POPULATE``: page tables only) and its first save copies at warm
speed (the same 512 MiB: 0.03 s to map, 0.05 s to copy).

Rules:

* only on a memory filesystem (a file on a disk would write every staged byte back to it), only
  for a pageable arena (a pinned one is page-locked anonymous memory), and only when the tier keeps
  room for :data:`ROOM_FACTOR` arenas' worth of checkpoints besides it (it shares /dev/shm with
  the checkpoints the tier holds; a tight /dev/shm keeps using anonymous memory, as before);
* the pages are allocated with ``posix_fallocate`` before they are mapped: a full tmpfs is an
  ``ENOSPC`` error here (anonymous memory is used instead, with a warning), never a SIGBUS when
  a staging copy touches a page that could not be allocated;
* it is opened without following a link below the tier, and used only when it is a regular
  file of this user, not writable by group or others (the tier's rule, engine/tiers/identity.py),
  with one link; anything else there is left alone (a warning; anonymous memory). The memory
  tier's writer lock, held by the Checkpointer, makes it one process's;
* its bytes are never read before a save writes them (staging copies, then hashes what it
  copied), so stale or planted contents cannot reach a checkpoint;
* ``close()`` (:meth:`ArenaFile.remove`) deletes it; a killed process leaves it for the next
  start, which resizes it to what it needs. Deleting the memory tier's directory removes it;
* an arena is owned by the holder of the tier's writer lock of the same name
  (``<tier>/locks/<name>.lock``; the kernel drops it when that process dies). When a writer
  takes its arena it deletes every other arena whose lock nobody holds (:func:`sweep_orphans`):
  a killed single process followed by a torchrun job (``writer`` then ``rank-<r>``), or 8 ranks
  followed by 4, leaves no arena nobody will map again.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import mmap
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from flashckpt.engine.tiers import identity as tierid
from flashckpt.engine.tiers.build import Tier
from flashckpt.errors import FlashCkptError
from flashckpt.store.files import removal, safeopen
from flashckpt.store.files.backend import LocalBackend
from flashckpt.store.lock import writer_holder

log = logging.getLogger(__name__)

DIR = "staging"
ROOM_FACTOR = 3  # the tier must keep room for this many arena-sized checkpoints besides it


@dataclass(frozen=True)
class Mapped:
    tensor: torch.Tensor  # ``nbytes`` uint8, page-aligned, resident
    reused_bytes: int  # bytes of it that were allocated already (left by an earlier process)


class ArenaFile:
    """The arena file of one writer (``name``: its lock name, one per rank) in ``tier``."""

    def __init__(self, tier: Path, name: str) -> None:
        self.tier = tier
        self.rel = f"{DIR}/{name}.arena"

    @property
    def path(self) -> Path:
        return self.tier / self.rel

    def map(self, nbytes: int) -> Mapped | None:
        """``nbytes`` of the file, allocated and mapped; None (logged) when it cannot be used,
        and the caller then takes anonymous memory."""
        try:
            fd = safeopen.open_nofollow(
                self.tier, self.rel, os.O_RDWR | os.O_CREAT, 0o600, create_dirs=True
            )
        except (OSError, FlashCkptError) as exc:
            log.warning("staging arena: not using %s (%s); using anonymous memory", self.path, exc)
            return None
        try:
            return self._map(fd, nbytes)
        finally:
            os.close(fd)

    def _map(self, fd: int, nbytes: int) -> Mapped | None:
        st = os.fstat(fd)
        problem = tierid.owner_problem(self.path, st, "staging arena")  # one rule for the tier
        if problem is None and st.st_nlink != 1:
            problem = f"staging arena {self.path} has {st.st_nlink} links (other names, same bytes)"
        if problem is not None:  # (open_nofollow refused anything but a regular file)
            log.warning("%s; leaving it alone, using anonymous memory", problem)
            return None
        held = st.st_blocks * 512  # pages allocated already (tmpfs: resident)
        free = shutil.disk_usage(self.tier).free + held
        if free - nbytes < ROOM_FACTOR * nbytes:
            log.info(
                "staging arena: %s has %d bytes free, under %d arenas of %d bytes besides the "
                "arena; using anonymous memory",
                self.tier,
                free,
                ROOM_FACTOR + 1,
                nbytes,
            )
            return None
        try:
            if st.st_size > nbytes:
                os.ftruncate(fd, nbytes)  # an earlier, larger arena: give back the rest
            os.posix_fallocate(fd, 0, nbytes)
            mm = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED | _POPULATE)
        except OSError as exc:
            if exc.errno == errno.ENOSPC:  # nothing half-allocated left in the tier
                with contextlib.suppress(OSError):  # (and this fallback never raises)
                    os.ftruncate(fd, 0)
            log.warning(
                "staging arena: cannot allocate %d bytes in %s (%s); using anonymous memory",
                nbytes,
                self.path,
                exc,
            )
            return None
        tensor = torch.from_numpy(np.frombuffer(mm, dtype=np.uint8))  # keeps ``mm`` alive
        return Mapped(tensor=tensor, reused_bytes=min(held, nbytes))

    def remove(self) -> None:
        """Delete the file, and its directory once empty (a clean close); a mapping still in
        use stays valid until it is dropped."""
        try:
            removal.unlink_nofollow(self.tier, self.rel)
            dfd = safeopen.open_dir(self.tier)
            try:
                os.rmdir(DIR, dir_fd=dfd)  # never follows a link; another writer's: ENOTEMPTY
            except OSError:
                pass
            finally:
                os.close(dfd)
        except (OSError, FlashCkptError) as exc:
            log.warning("staging arena: could not remove %s: %s", self.path, exc)


_POPULATE = getattr(mmap, "MAP_POPULATE", 0)
_ARENA_RE = re.compile(r"^(writer|rank-[0-9]{1,7})\.arena$")  # the writer lock names


def sweep_orphans(tier: Path, *, own: str) -> list[str]:
    """Delete the arenas in ``tier`` whose writer lock nobody holds (their process is gone),
    except writer ``own``'s; returns the names deleted. Only files named like an arena are
    considered (anything else in ``staging/`` is left alone), each re-checked by the lock
    probe; a failure is logged and leaves the file."""
    try:
        names = safeopen.list_names(tier, DIR)
    except FileNotFoundError:
        return []
    except (OSError, FlashCkptError) as exc:
        log.warning("staging arena: cannot look for orphaned arenas in %s: %s", tier / DIR, exc)
        return []
    swept: list[str] = []
    for entry in names:
        match = _ARENA_RE.match(entry)
        if match is None or match.group(1) == own:
            continue
        try:
            if writer_holder(tier, name=match.group(1)) is not None:
                continue  # its writer lives (another rank of this node)
            if not safeopen.is_regular(tier, f"{DIR}/{entry}"):
                continue
            removal.unlink_nofollow(tier, f"{DIR}/{entry}")
            swept.append(entry)
        except (OSError, FlashCkptError) as exc:
            log.warning("staging arena: not removing orphaned %s: %s", tier / DIR / entry, exc)
    if swept:
        log.info("staging arena: removed %s in %s (their writers are gone)", swept, tier / DIR)
    return swept


def arena_for(tier: Tier, *, name: str) -> ArenaFile | None:
    """The arena file of writer ``name`` (its lock name) when ``tier``, the fastest, is a memory
    tier on a memory filesystem; else None (the arena is anonymous memory)."""
    backend = tier.store.backend
    if tier.name != "memory" or tier.path is None or not isinstance(backend, LocalBackend):
        return None
    if not backend.in_memory:
        return None
    sweep_orphans(tier.path, own=name)  # this writer holds the tier's lock ``name`` already
    return ArenaFile(tier.path, name)
