"""The run journal: one JSON object per line in ``ROOT/journal.jsonl``.

Every line is written with a single ``write`` on a file opened with ``O_APPEND``, so lines from
several processes (ranks, restarts) never interleave on a local filesystem. Readers tolerate a
torn last line (a crash mid-write) and skip any line that is not a JSON object.

Each event has at least ``{"t": unix_time_s, "event": NAME, "pid": int}`` plus ``rank`` when
running under torch.distributed. Event names and their fields:

==================  ===========================================================================
``run_start``        ``clean_previous: bool`` (False when the previous run left its marker)
``crash_detected``   ``last_step: int|None``, ``since_t: float`` (start of the crashed run)
``run_end``          ``step: int|None``
``save_start``       ``step``
``staged``           ``step``, ``blocking_s`` (time the training thread was blocked)
``durable``          ``step``, ``tier``, ``background_s``, ``total_bytes``, ``new_bytes``,
                     ``reused_bytes``, ``chunks_new``, ``chunks_reused``, ``throughput_Bps``
``save_failed``      ``step``, ``error``
``save_skipped``     ``step``, ``reason``
``promoted``         ``step``, ``src``, ``dst``, ``seconds``, ``bytes``
``restore``          ``step``, ``tier``, ``seconds``, ``bytes``
``corrupt``          ``step``, ``tier``, ``error``
``scrub_damage``     ``tier``, ``chunk``, ``steps``, ``error``, ``quarantined`` (the idle scrub
                     found a committed chunk damaged: engine/tiers/scrubbing.py)
``scrubbed``         ``tier``, ``bytes``, ``chunks``, ``seconds`` (what the idle scrub read and
                     verified in that tier since its last ``scrubbed``, every 10 minutes)
``steps_lost``       ``from_step``, ``to_step``, ``steps``
``restart``          ``step`` (first resumed), ``restart_seconds`` (kill -> that step) = ``down_s``
                     + ``start_s`` + ``restore_s`` (null: nothing loaded) + ``first_step_s``;
                     ``restored_step``, ``killed_t``, ``process_t``, ``start_source``,
                     ``imported_s``, ``ready_s`` (see engine/runtime/restart.py)
``step_time``        ``step``, ``seconds`` (mean training step time since the last record)
``memory``           ``phase``, ``allocated_bytes``, ``reserved_bytes``, ``max_allocated_bytes``,
                     ``fragmentation_bytes``, ``alloc_retries``
``interval``         ``policy``, ``interval_s``, ``interval_steps``, ``cost_s``, ``mtbf_s``,
                     ``restart_s``, ``persist_s``, ``reason``
``gc``               ``chunks_deleted``, ``bytes_deleted``
``gc_skipped``       ``tier``, ``reason`` (a writer held the root, or something was unreadable)
``vanished``         ``step``, ``tier``, ``error`` (deleted by retention while read: not damage)
``tier_unavailable`` ``tier``, ``error``
``promote_failed``   ``step``, ``src``, ``dst``, ``attempt``, ``error``, ``retry_in_s``
``promote_abandoned`` ``step``, ``src``, ``dst``/``reason`` (given up, or dropped at close)
``promote_skipped``  ``step``, ``newer`` (queue full with ``on_full="skip"``)
``promote_stuck``    ``reason`` (the promoter did not stop at close; tier locks stay held)
``save_abandoned``   ``step``, ``reason`` (process exit while the save was in flight)
``damaged_step_replaced`` ``step``, ``tiers`` (a step restore found damaged, saved anew)
``preempted``        ``step`` and the signal's timing (SIGTERM handling)
``abandoned_copy``   ``step``, ``tier``, ``generation``, ``newest_generation``, ``verdict``
                     (``abandoned``/``superseded``), ``removed`` (a copy lineage says is not
                     the checkpoint: skipped by restore; removed from the writer's own memory
                     tier, see engine/restore/lineage.py); ``node`` for a node tier (peer
                     replication: journaled by that node's leader only,
                     distributed/replication/nodelineage.py)
==================  ===========================================================================
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from flashckpt.errors import FlashCkptError
from flashckpt.store.files import safeopen
from flashckpt.store.files.jsonfile import load_object

log = logging.getLogger(__name__)

JOURNAL_NAME = "journal.jsonl"
MAX_LINE_BYTES = 1 << 20  # longer lines are skipped (no event is anywhere near this)
MAX_LINE_DEPTH = 16
# A journal larger than this is read from its last MAX_JOURNAL_BYTES only (size from fstat,
# before reading: a sparse "1 TiB journal" is not read through). A long run writes ~100 MiB.
MAX_JOURNAL_BYTES = 256 << 20


class Journal:
    """Appends events to a journal file. Never raises on write failure (logs instead)."""

    def __init__(self, path: str | os.PathLike[str], *, rank: int | None = None) -> None:
        self.path = Path(path)
        self.rank = rank

    def append(self, event: str, **fields: Any) -> dict[str, Any]:
        record: dict[str, Any] = {"t": time.time(), "event": event, "pid": os.getpid()}
        if self.rank is not None:
            record["rank"] = self.rank
        record.update(fields)
        line = (json.dumps(record, separators=(",", ":"), default=str) + "\n").encode()
        try:
            safeopen.make_anchor(self.path.parent)
            fd = safeopen.open_nofollow(
                self.path.parent, self.path.name, os.O_WRONLY | os.O_APPEND | os.O_CREAT
            )
            try:
                os.write(fd, line)
            finally:
                os.close(fd)
        except (OSError, FlashCkptError) as exc:  # the journal must never break training
            log.warning("could not append to journal %s: %s", self.path, exc)
        return record


def read_events(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """All well-formed events in the journal at ``path`` (a file or a checkpoint root)."""
    return list(iter_events(path))


def iter_events(path: str | os.PathLike[str]) -> Iterator[dict[str, Any]]:
    """Well-formed events, oldest first. A line that is torn, too long, nested too deep, not
    an object, or whose ``event`` is not a string is skipped; a journal that is a symlink,
    FIFO or other non-regular file yields nothing (with a warning), so no reader hangs."""
    p = Path(path)
    if p.is_dir():
        p = p / JOURNAL_NAME
    try:
        fd = safeopen.open_nofollow(p.parent, p.name, os.O_RDONLY)
    except FileNotFoundError:
        return
    except (OSError, FlashCkptError) as exc:
        log.warning("not reading journal %s: %s", p, exc)
        return
    with os.fdopen(fd, "rb") as f:
        _skip_to_tail(f, p)
        while raw := f.readline(MAX_LINE_BYTES + 1):
            if len(raw) > MAX_LINE_BYTES:
                while raw and not raw.endswith(b"\n"):  # skip the rest of the long line
                    raw = f.readline(MAX_LINE_BYTES)
                continue
            obj = parse_line(raw, where=str(p))
            if obj is not None:
                yield obj


def _skip_to_tail(f: Any, p: Path) -> None:
    size = os.fstat(f.fileno()).st_size
    if size <= MAX_JOURNAL_BYTES:
        return
    log.warning(
        "journal %s is %d bytes; reading only its last %d bytes", p, size, MAX_JOURNAL_BYTES
    )
    f.seek(size - MAX_JOURNAL_BYTES)
    f.readline(MAX_LINE_BYTES + 1)  # the rest of a line that started before the tail


def parse_line(raw: bytes, *, where: str = JOURNAL_NAME) -> dict[str, Any] | None:
    """One journal line as an event, or None when it is not a well-formed one."""
    try:
        obj = load_object(
            raw, where=where, max_bytes=MAX_LINE_BYTES, max_depth=MAX_LINE_DEPTH, allow_nan=True
        )
    except FlashCkptError:
        return None  # a torn line from a crash mid-append, or garbage
    return obj if well_typed(obj) else None


_INT_FIELDS = (
    "step",
    "pid",
    "rank",
    "last_step",
    "last_trained_step",
    "from_step",
    "to_step",
    "restored_step",
)


# A journal time is a Unix time in seconds: between 1970 and the year 5138. Anything else
# (t = 1e308, -1e308) is not a time any clock wrote, and would overflow the report's dates.
MAX_T = 1e11
# Integers every reader may turn into a float or a C long: |v| < 2**53 (a step is < 10**15;
# a 401-digit step overflowed float() in status, report and the Prometheus exposition).
MAX_INT = 1 << 53


def well_typed(obj: Mapping[str, Any]) -> bool:
    """The fields every reader relies on have their documented types: ``event`` a string,
    ``t`` a finite Unix time, step/rank/pid fields an integer of sane size or null (a line
    that lies about them is skipped whole rather than crashing the report or the interval
    policy). Other numbers are checked by their readers (``report.summary.num``)."""
    t = obj.get("t")
    if not isinstance(obj.get("event"), str) or not isinstance(t, (int, float)):
        return False
    if isinstance(t, bool) or (isinstance(t, int) and abs(t) > MAX_INT):
        return False
    if not math.isfinite(t) or not 0 <= t < MAX_T:
        return False
    for k in _INT_FIELDS:  # a plain loop: this runs once per journal line read
        v = obj.get(k)
        if v is not None and (type(v) is not int or not -MAX_INT < v < MAX_INT):
            return False
    return True


class JournalTail:
    """A journal read incrementally: each :meth:`poll` parses only the lines appended since
    the last one (it remembers the byte offset; a torn last line is kept until it is
    complete), so a reader that polls (the Prometheus exporter, once per scrape) costs what
    was appended, not the whole journal. A journal that was replaced or truncated (another
    inode, or shorter than the offset) is read again from the start."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        p = Path(path)
        self.path = p / JOURNAL_NAME if p.is_dir() else p
        self.lines_parsed = 0  # every line parse_line saw, for tests and the curious
        self.resets = 0  # times the journal was found replaced or truncated (events start over)
        self._inode: tuple[int, int] | None = None
        self._reset()

    def _reset(self) -> None:
        self.events: list[dict[str, Any]] = []
        self._offset = 0
        self._partial = b""

    def poll(self) -> int:
        """Read what was appended; the number of new well-formed events."""
        try:
            fd = safeopen.open_nofollow(self.path.parent, self.path.name, os.O_RDONLY)
        except FileNotFoundError:
            return 0
        except (OSError, FlashCkptError) as exc:
            log.warning("not reading journal %s: %s", self.path, exc)
            return 0
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(f.fileno())
            if (st.st_dev, st.st_ino) != self._inode or st.st_size < self._offset:
                self.resets += self._inode is not None
                self._reset()
                self._inode = (st.st_dev, st.st_ino)
                if st.st_size > MAX_JOURNAL_BYTES:
                    _skip_to_tail(f, self.path)
                    self._offset = f.tell()
            f.seek(self._offset)
            before = len(self.events)
            while raw := f.readline(MAX_LINE_BYTES + 1):
                self._offset += len(raw)
                line, self._partial = self._partial + raw, b""
                if not line.endswith(b"\n"):
                    self._partial = line if len(line) <= MAX_LINE_BYTES else b""
                    continue
                self.lines_parsed += 1
                obj = parse_line(line, where=str(self.path))
                if obj is not None:
                    self.events.append(obj)
            return len(self.events) - before
