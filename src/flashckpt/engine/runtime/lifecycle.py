"""The run marker: how a new run learns that the previous one died without ``close()``, and
how much work it lost.

``RunMarker.start`` journals ``crash_detected`` when the previous run's marker is still there
(with the last step that run reported through ``should_save``), then ``run_start``, and writes
its own marker. ``tick(step)`` overwrites the step in place on every training step (a small
``pwrite`` to the page cache, no fsync: a process crash cannot lose it, only a machine crash).
After the first restore, ``restored(step)`` journals ``steps_lost`` = the crashed run's last step
minus the restored step. ``end`` journals ``run_end`` and removes the marker.

After a crash the marker also times the restart (engine/runtime/restart.py): ``restoring()`` and
``restored(step)`` bracket the restore call, and the first ``tick`` after it journals
``restart`` (kill -> first resumed step, in parts).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from flashckpt.distributed.standby import role as roles
from flashckpt.engine.runtime.restart import RestartClock
from flashckpt.errors import FlashCkptError
from flashckpt.journal import Journal, read_events
from flashckpt.store.files import removal, safeopen
from flashckpt.store.files.jsonfile import load_object
from flashckpt.store.store import CheckpointStore

MARKER = "locks/running.json"
_WIDTH = 96  # fixed record size, so each tick overwrites the whole record


class RunMarker:
    """One marker per writer (``name`` is the lock name: one per rank). Only the primary writer
    (rank 0) journals crashes and lost steps, so a crash of an N-rank job counts once."""

    def __init__(self, root: Path, journal: Journal, *, name: str = "writer", primary: bool = True):
        self.root = root
        self.rel = MARKER if name == "writer" else f"locks/running-{name}.json"
        self.path = root / self.rel
        self.journal = journal
        self.primary = primary
        self.crashed_at_step: int | None = None
        self.restart: RestartClock | None = None  # set after a crash (primary writer only)
        self._fd: int | None = None
        self._t0 = time.time()
        self._stepped = False  # the launcher was told of the first step (role.say_stepped)

    def start(self, store: CheckpointStore, save_policy: Any, *learners: Any) -> None:
        """Journal the crash of the previous run (if any), open this run's marker, and give
        the journal's history to the save policy and to each of ``learners`` (each has
        ``observe_history(events)``: the governor's foreground cost, engine/runtime/governor.py)."""
        crashed = _exists(self.root, self.rel)
        if crashed and self.primary:
            last = _read(self.root, self.rel).get("step")
            self.crashed_at_step = last if isinstance(last, int) else None
            steps = store.steps()
            since_t = safeopen.lstat_in(self.root, self.rel).st_mtime
            self.restart = RestartClock(self.journal, signs_of_life=[since_t, _mtime(self.journal)])
            self.journal.append(
                "crash_detected",
                last_step=steps[-1] if steps else None,
                last_trained_step=self.crashed_at_step,
                since_t=since_t,
            )
        if self.primary:
            self.journal.append("run_start", clean_previous=not crashed)
        if crashed and not safeopen.is_regular(self.root, self.rel):
            removal.unlink_nofollow(self.root, self.rel)  # a planted link/FIFO: drop, not follow
        self._fd = safeopen.open_nofollow(
            self.root, self.rel, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, create_dirs=True
        )
        self.tick(None)
        found = [getattr(x, "observe_history", None) for x in (save_policy, *learners)]
        observers: list[Callable[[list[dict[str, Any]]], None]] = [o for o in found if o]
        if observers:
            events = read_events(self.journal.path)  # once: a long run's journal is large
            for observe in observers:
                observe(events)

    def tick(self, step: int | None) -> None:
        if self._fd is None:
            return
        record = json.dumps({"pid": os.getpid(), "t": self._t0, "step": step}).ljust(_WIDTH)
        os.pwrite(self._fd, record.encode()[:_WIDTH], 0)
        if step is not None and not self._stepped:  # flashckpt run starts a standby now
            self._stepped = True
            roles.say_stepped()
        if self.restart is not None and step is not None:
            self.restart.tick(step)
            if self.restart.done:  # journaled: later ticks skip it
                self.restart = None

    def took_over(self, woke_t: float) -> None:
        """This run is a warm standby that took over at ``woke_t`` (engine/runtime/takeover.py)."""
        if self.restart is not None:
            self.restart.takeover(woke_t)

    def restoring(self) -> None:
        """A restore call begins (times the restart; nothing else)."""
        if self.restart is not None:
            self.restart.restoring()

    def restored(self, step: int) -> None:
        """Journal the work the crashed run lost (once, after the first restore)."""
        if self.restart is not None:
            self.restart.restored(step)
        last, self.crashed_at_step = self.crashed_at_step, None
        if last is not None and last > step and self.primary:
            self.journal.append("steps_lost", from_step=step, to_step=last, steps=last - step)

    def end(self, last_step: int | None) -> None:
        if self.primary:
            self.journal.append("run_end", step=last_step)
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        removal.unlink_nofollow(self.root, self.rel)


def _mtime(journal: Journal) -> float | None:
    try:
        return os.lstat(journal.path).st_mtime
    except OSError:
        return None


def _exists(root: Path, rel: str) -> bool:
    """Whether a marker entry is there at all (a planted link or FIFO counts: it is replaced)."""
    try:
        safeopen.lstat_in(root, rel)
    except (OSError, FlashCkptError):
        return False
    return True


def _read(root: Path, rel: str) -> dict[str, Any]:
    """The previous run's marker record; {} when it is unreadable, not a regular file, or not
    a small flat JSON object (it is only a hint about the crashed run's last step)."""
    try:
        data = safeopen.read_file(root, rel, max_bytes=4 * _WIDTH)
        return load_object(data.strip() or b"{}", where=str(root / rel), max_bytes=4 * _WIDTH)
    except (OSError, FlashCkptError):
        return {}
