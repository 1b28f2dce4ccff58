"""Pins: the writer windows and promotion pins of the liveness module, and their files at rest,
``ROOT/pins/<host>-<pid>-<n>.json`` (one per save or promotion in flight).

A pin file records who holds it (host, pid, time), what for (``kind``: ``save`` or
``promote``, and the step) and the chunk hashes it keeps alive. Its ``state`` is ``open``
while the owner works, or ``failed`` when the owner gave up: the hashes of a failed pin are
what that save or promotion wrote, i.e. candidates for the next garbage collection, which
deletes the file once it has dealt with them. Written atomically through the backend, read by
the garbage collection of any process (:mod:`flashckpt.store.liveness`):

* an ``open`` pin whose owner is alive (or on another host) keeps its hashes;
* a pin whose owner is dead on this host has expired: gc removes it and sweeps the whole tier
  (whatever that process wrote after its last record is unknown);
* a pin that cannot be read or parsed aborts the collection (fail closed).
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import socket
import threading
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol

from flashckpt.errors import FlashCkptError, StorageError
from flashckpt.store.files.backend import Backend
from flashckpt.store.files.jsonfile import load_json
from flashckpt.store.files.limits import MAX_PIN_BYTES
from flashckpt.store.format.manifest import HASH_RE, ChunkRef
from flashckpt.store.lock import RootLock

log = logging.getLogger(__name__)


class Liveness(Protocol):
    """The side of :class:`flashckpt.store.liveness.Liveness` that windows and pins work on
    (its reference counts, under its mutex). Named here so that liveness, which hands out
    windows and pins, imports this module and not the other way round."""

    backend: Backend
    lock: RootLock | None
    mutex: threading.RLock
    pins_on_disk: bool
    candidates: set[str]
    _writing: Counter[str]

    def find(self, h: str, size: int | None = None) -> ChunkRef | None: ...

    def _pin(self, hashes: Iterable[str], delta: int) -> None: ...


PIN_DIR = "pins"
HOST = socket.gethostname()
_counter = itertools.count()


def _boot_id() -> str:
    """This boot of this host (Linux); a pin from an earlier boot has expired whatever its pid."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


BOOT = _boot_id()


class PinReadError(StorageError):
    """A pin file exists but cannot be read or understood: garbage collection must not run."""


@dataclass(kw_only=True)
class PinRecord:
    name: str  # file name under pins/
    host: str
    pid: int
    kind: str
    step: int | None
    state: str = "open"  # "open" or "failed"
    boot: str = BOOT
    time_s: float = field(default_factory=time.time)
    hashes: list[str] = field(default_factory=list)

    @property
    def path(self) -> str:
        return f"{PIN_DIR}/{self.name}"

    def to_json(self) -> bytes:
        doc = {
            "version": 1,
            "host": self.host,
            "pid": self.pid,
            "kind": self.kind,
            "step": self.step,
            "state": self.state,
            "boot": self.boot,
            "time": self.time_s,
            "hashes": sorted(self.hashes),
        }
        return json.dumps(doc, separators=(",", ":")).encode()

    def owner_dead(self) -> bool:
        """True only when the owner is known to be gone: same host, and an earlier boot or no
        such process."""
        if self.host != HOST:
            return False
        return bool(self.boot and BOOT and self.boot != BOOT) or not pid_alive(self.pid)


def new_record(*, kind: str, step: int | None, hashes: list[str] | None = None) -> PinRecord:
    pid = os.getpid()
    name = f"{_safe(HOST)}-{pid}-{next(_counter)}-{time.time_ns() % 10**9}.json"
    return PinRecord(name=name, host=HOST, pid=pid, kind=kind, step=step, hashes=hashes or [])


def pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    except OSError:
        return True
    return True


def write_pin(backend: Backend, rec: PinRecord) -> None:
    backend.put(rec.path, [rec.to_json()])


def read_pins(backend: Backend) -> list[PinRecord]:
    """Every pin file of the tier; raises :class:`PinReadError` on any one it cannot read."""
    try:
        names = backend.list(PIN_DIR)
    except OSError as exc:
        raise PinReadError(f"cannot list {backend.url}/{PIN_DIR}: {exc}") from exc
    out = []
    for name in names:
        try:
            data = backend.read(f"{PIN_DIR}/{name}")
        except FileNotFoundError:
            continue  # released between list and read: nothing to keep
        except (OSError, FlashCkptError) as exc:  # FlashCkptError: too large to be a pin
            raise PinReadError(f"cannot read pin {backend.url}/{PIN_DIR}/{name}: {exc}") from exc
        try:
            out.append(parse_pin(name, data, where=f"{backend.url}/{PIN_DIR}/{name}"))
        except PinReadError as exc:
            dead = _dead_writer_of(name)
            if dead is None:
                raise
            # a pin torn by a writer that is gone (its own name says who: this host, a pid no
            # longer alive) protects nothing a future commit needs; what that writer wrote is
            # unknown, so it is handled like any expired pin: removed, and the tier swept
            log.warning(
                "%s; its writer (pid %d on this host) is gone: treated as expired", exc, dead
            )
            rec = PinRecord(name=name, host=HOST, pid=dead, kind="unreadable", step=None)
            rec.state = "failed"
            out.append(rec)
    return out


def _drop_failed_pin(backend: Backend, rec: PinRecord | None) -> None:
    """A pin whose write failed may still be on disk, torn (a filesystem that tore the
    rename's target); it names nothing anyone needs, so its writer removes it, best effort:
    left there it would stop every gc of the tier while this process lives."""
    if rec is None:
        return
    try:
        backend.delete(rec.path)
    except (OSError, StorageError) as exc:
        log.warning("could not remove the failed pin %s: %s", rec.path, exc)


def _dead_writer_of(name: str) -> int | None:
    """The pid of the writer that ``name`` (``<host>-<pid>-<n>-<ns>.json``, new_record's
    form) says made it, when that is this host and the pid is not alive; else None."""
    stem = name[: -len(".json")] if name.endswith(".json") else ""
    parts = stem.rsplit("-", 3)
    if len(parts) != 4 or parts[0] != _safe(HOST) or not parts[1].isdigit() or len(parts[1]) > 9:
        return None
    pid = int(parts[1])
    return None if pid_alive(pid) else pid


def parse_pin(name: str, data: bytes, *, where: str) -> PinRecord:
    try:
        doc = load_json(data, where=where, max_bytes=MAX_PIN_BYTES, max_depth=4, error=PinReadError)
        hashes = doc["hashes"]
        ok = (
            isinstance(doc, dict)
            and isinstance(doc["host"], str)
            and isinstance(doc["pid"], int)
            and 0 <= doc["pid"] < 1 << 31  # a pid: os.kill of a 401-digit one overflows
            and doc.get("state", "open") in ("open", "failed")
            and isinstance(hashes, list)
            and all(isinstance(h, str) and HASH_RE.match(h) for h in hashes)
        )
        step = doc.get("step")
        if not ok or not (step is None or isinstance(step, int)):
            raise ValueError("unexpected fields")
        return PinRecord(
            name=name,
            host=doc["host"],
            pid=doc["pid"],
            kind=str(doc.get("kind", "")),
            step=step,
            state=doc.get("state", "open"),
            boot=str(doc.get("boot", "")),
            time_s=float(doc.get("time", 0.0)),
            hashes=list(hashes),
        )
    except (
        ValueError,
        KeyError,
        TypeError,
        UnicodeDecodeError,
        OverflowError,
        PinReadError,
    ) as exc:
        raise PinReadError(
            f"pin {where} is unreadable ({exc}); garbage collection keeps everything until it "
            "is fixed: remove the file by hand only if no save or promotion is running"
        ) from None


def _safe(host: str) -> str:
    return "".join(c if c.isalnum() or c in "-_" else "_" for c in host)[:64] or "host"


class Window:
    """One save or promotion writing into a tier; see the module docstring."""

    def __init__(self, live: Liveness, *, kind: str, step: int | None) -> None:
        self._live = live
        self.record = new_record(kind=kind, step=step)
        self._pinned: set[str] = set()
        self._writes: set[str] = set()
        self._closed = False
        if live.lock is not None:
            live.lock.hold_shared()
        try:
            if live.pins_on_disk:
                write_pin(live.backend, self.record)
        except BaseException:
            _drop_failed_pin(live.backend, self.record)
            if live.lock is not None:
                live.lock.release_shared()
            raise

    @property
    def hashes(self) -> set[str]:
        return set(self._pinned)

    def claim(self, h: str, size: int, *, reuse: bool = True) -> ChunkRef | None:
        """Pin ``h``; the verified stored ref to reuse (``reuse=True``), or None: write it."""
        live = self._live
        with live.mutex:
            if self._closed:
                raise FlashCkptError(f"claim of chunk {h} after the window closed (internal)")
            if h not in self._pinned:
                self._pinned.add(h)
                live._pin([h], +1)
            ref = live.find(h, size) if reuse else None
            if ref is None and h not in self._writes:
                self._writes.add(h)
                live._writing[h] += 1
            return ref

    def committed(self) -> None:
        """The manifest naming every claimed chunk is committed: the pins go."""
        self._close(failed=False)

    def failed(self) -> None:
        """The save or promotion gave up: what it claimed for writing is garbage unless a
        manifest or another pin names it. Call ``gc.collect_garbage`` afterwards."""
        self._close(failed=True)

    def _close(self, *, failed: bool) -> None:
        live = self._live
        with live.mutex:
            if self._closed:
                return
            self._closed = True
            live._pin(self._pinned, -1)
            for h in self._writes:
                live._writing[h] -= 1
                if live._writing[h] <= 0:
                    del live._writing[h]
            if failed:
                live.candidates |= self._writes
        try:
            if not live.pins_on_disk:
                pass
            elif failed and self._writes:  # tell the other processes' gc what to look at
                self.record.state, self.record.hashes = "failed", sorted(self._writes)
                write_pin(live.backend, self.record)
            else:
                live.backend.delete(self.record.path)
        except (OSError, StorageError) as exc:
            log.warning("could not update pin %s: %s", self.record.path, exc)
            _drop_failed_pin(live.backend, self.record)  # never leave a torn one behind
        finally:
            if live.lock is not None:
                live.lock.release_shared()


class Pin:
    """Chunks kept alive for a queued promotion (no lock held); :meth:`release` once."""

    def __init__(self, live: Liveness, hashes: set[str], *, kind: str, step: int | None) -> None:
        self._live = live
        self.hashes = frozenset(hashes)
        self.record: PinRecord | None = new_record(kind=kind, step=step, hashes=sorted(hashes))
        with live.mutex:
            live._pin(self.hashes, +1)
        try:
            if live.pins_on_disk:
                write_pin(live.backend, self.record)
            else:
                self.record = None
        except OSError as exc:  # this process still honours it; other processes may not
            log.warning("could not record pin of step %s on disk: %s", step, exc)
            _drop_failed_pin(live.backend, self.record)
            self.record = None

    def release(self) -> None:
        live = self._live
        with live.mutex:
            if self.record is None and not self.hashes:
                return
            live._pin(self.hashes, -1)
            self.hashes = frozenset()
        if self.record is not None:
            try:
                live.backend.delete(self.record.path)
            except OSError as exc:
                log.warning("could not remove pin %s: %s", self.record.path, exc)
            self.record = None
