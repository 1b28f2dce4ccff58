"""A fault-injecting storage layer for the torture harness.

:func:`install` wraps the methods of :class:`flashckpt.store.files.backend.LocalBackend` (the class
every local tier, the CLI and gc use) for the duration of a test. Whether a call fails is a pure
function of ``(seed, operation index, method, path, n-th such call in this operation)``, so the
same seed injects the same faults whatever order the library's threads make their calls in.

Fault kinds (``FaultPlan.rates`` gives each a per-call probability while the plan is on):

``eio_read``   read / read_into / map / exists / size raise EIO (transient: the file is intact)
``eio_list``   list raises EIO
``eio_write``  put raises EIO, nothing written (``put`` here and below also stands for the
               publish of a staged chunk, ``open_staged``: a chunk written as it is staged)
``enospc``     put raises ENOSPC, nothing written
``eio_sync``   sync_dirs raises EIO (only on backends that fsync)
``eio_delete`` delete silently does nothing (the real backend swallows unlink errors)
``torn``       put leaves a truncated file at the final name, then raises EIO (only where no
               file is yet: put replaces an existing one by a rename, which cannot tear it)
``bitflip``    put succeeds, then one bit of the stored chunk flips (silent rot)
``slow``       put / read sleep a few milliseconds first

Damage the harness causes (torn, bitflip, and the ``vanish`` / ``rot`` / ``inplace`` operations
of the simulation) is recorded as a *taint* so the oracle can tell it from damage the library
caused. ``inplace`` (:func:`damage_in_place`) changes a stored chunk's bytes without changing its
size (a byte written with ``pwrite``, or a hole punched with ``fallocate``): unlike ``rot`` it
excuses only the steps committed before it (issue 27: no later save may reuse that chunk).

A *generation* is one simulated process: every backend created while ``plan.generation == g``
belongs to ``g``. ``plan.kill(g, after=n)`` makes generation ``g`` die after ``n`` more calls:
from then on its writes and reads fail and its deletes do nothing, as if the process were gone.
``plan.kill_after_manifest(g, tier)`` makes it die right after its next step manifest in ``tier``
is published (before the save can report).
"""

from __future__ import annotations

import errno
import os
import random
import re
import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flashckpt.errors import StorageError
from flashckpt.store.files.backend import LocalBackend

KINDS = (
    "eio_read",
    "eio_list",
    "eio_write",
    "enospc",
    "eio_sync",
    "eio_delete",
    "torn",
    "bitflip",
    "slow",
)

MANIFEST_RE = re.compile(r"steps/\d{12}\.json")  # a step's manifest (not a rank's part)

# counts over the whole pytest session, printed by conftest.py at the end
STATS: Counter[str] = Counter()
_stats_lock = threading.Lock()


def count(name: str, n: int = 1) -> None:
    with _stats_lock:
        STATS[name] += n


@dataclass(frozen=True)
class Taint:
    kind: str  # torn, bitflip, rot, vanish
    tier: str  # the tier directory (absolute)
    path: str  # relative to the tier directory
    op: int  # operation index when it happened


@dataclass
class FaultPlan:
    seed: int
    scope: Path  # only backends whose root is under this directory are touched
    rates: dict[str, float] = field(default_factory=dict)
    enabled: bool = False
    op: int = 0
    generation: int = 0
    taints: list[Taint] = field(default_factory=list)
    injected: Counter[str] = field(default_factory=Counter)
    sabotage: Any = None  # test hook: called as sabotage(method, backend, path) before a call
    _calls: Counter[tuple[str, str]] = field(default_factory=Counter)
    _dead: dict[int, int] = field(default_factory=dict)  # generation -> calls left
    _die_after_manifest: dict[int, str] = field(default_factory=dict)  # generation -> tier
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def begin_op(self, op: int, rates: dict[str, float]) -> None:
        with self._lock:
            self.op = op
            self.rates = dict(rates)
            self._calls.clear()
        self.enabled = bool(rates)

    @contextmanager
    def off(self) -> Iterator[None]:
        """No faults inside (the oracle's own reads and checks)."""
        was, self.enabled = self.enabled, False
        try:
            yield
        finally:
            self.enabled = was

    def kill(self, generation: int, *, after: int = 0) -> None:
        with self._lock:
            self._dead[generation] = after

    def kill_after_manifest(self, generation: int, tier: Path) -> None:
        """Generation ``generation`` dies right after its next manifest in ``tier`` is
        published (the rename done, before anything else: the save has not reported)."""
        with self._lock:
            self._die_after_manifest[generation] = os.path.realpath(tier)

    def published(self, backend: LocalBackend, path: str) -> None:
        gen = getattr(backend, "_torture_gen", None)
        with self._lock:
            where = self._die_after_manifest.get(gen)  # type: ignore[arg-type]
            if where is None or not MANIFEST_RE.fullmatch(path):
                return
            if os.path.realpath(backend.root) != where:
                return
            del self._die_after_manifest[gen]  # type: ignore[arg-type]
            self._dead[gen] = 0  # type: ignore[index]
        count("sim.killed_after_manifest")

    def is_dead(self, generation: int) -> bool:
        with self._lock:
            left = self._dead.get(generation)
            if left is None:
                return False
            if left > 0:
                self._dead[generation] = left - 1
                return False
            return True

    def draw(self, kind: str, method: str, path: str) -> bool:
        rate = self.rates.get(kind, 0.0) if self.enabled else 0.0
        if rate <= 0.0:
            return False
        with self._lock:
            self._calls[(method, path)] += 1
            n = self._calls[(method, path)]
        rnd = random.Random(f"{self.seed}|{self.op}|{kind}|{method}|{path}|{n}").random()
        if rnd < rate:
            with self._lock:
                self.injected[kind] += 1
            count(f"fault.{kind}")
            return True
        return False

    def rng(self, *key: object) -> random.Random:
        return random.Random("|".join(map(str, (self.seed, self.op, *key))))

    def taint(self, kind: str, tier: Path, path: str) -> None:
        with self._lock:
            self.taints.append(Taint(kind=kind, tier=str(tier), path=path, op=self.op))


_ACTIVE: FaultPlan | None = None
_ORIG: dict[str, Any] = {}


def _plan_for(backend: LocalBackend) -> FaultPlan | None:
    plan = _ACTIVE
    if plan is None:
        return None
    try:
        Path(backend.root).relative_to(plan.scope)
    except ValueError:
        return None
    return plan


def _err(op: str, backend: LocalBackend, path: str, code: int, what: str) -> StorageError:
    err = StorageError(f"could not {op} {backend.root / path}: {os.strerror(code)} ({what})")
    err.errno = code
    return err


def _dead(plan: FaultPlan, backend: LocalBackend) -> bool:
    gen = getattr(backend, "_torture_gen", None)
    return gen is not None and plan.is_dead(gen)


def _init(self: LocalBackend, root: Any, *args: Any, **kw: Any) -> None:
    _ORIG["__init__"](self, root, *args, **kw)
    plan = _plan_for(self)
    if plan is not None:
        self._torture_gen = plan.generation  # type: ignore[attr-defined]


def _put(self: LocalBackend, path: str, parts: Any) -> int:
    plan = _plan_for(self)
    if plan is None:
        return int(_ORIG["put"](self, path, parts))
    if plan.sabotage is not None:
        plan.sabotage("put", self, path)
    if _dead(plan, self):
        raise _err("write", self, path, errno.EIO, "the simulated process is dead")
    if plan.draw("slow", "put", path):
        time.sleep(plan.rng("slow", path).uniform(0.001, 0.015))
    if plan.draw("enospc", "put", path):
        raise _err("write", self, path, errno.ENOSPC, "injected")
    if plan.draw("eio_write", "put", path):
        raise _err("write", self, path, errno.EIO, "injected")
    if plan.draw("torn", "put", path) and not (self.root / path).exists():
        data = b"".join(bytes(memoryview(p).cast("B")) for p in parts)
        keep = plan.rng("torn", path).randrange(0, max(len(data), 1))
        dst = self.root / path
        dst.parent.mkdir(parents=True, exist_ok=True)
        dst.write_bytes(data[:keep])
        plan.taint("torn", self.root, path)
        raise _err("write", self, path, errno.EIO, "injected torn write")
    n = int(_ORIG["put"](self, path, parts))
    plan.published(self, path)
    if path.startswith("chunks/") and n > 0 and plan.draw("bitflip", "put", path):
        flip_bit(self.root / path, plan.rng("bitflip", path))
        plan.taint("bitflip", self.root, path)
    return n


class _FaultyStaged:
    """A staged chunk (``LocalBackend.open_staged``: written as its bytes arrive, named at
    publish) under the same faults as ``put``, drawn when its final path is known."""

    def __init__(self, backend: LocalBackend, plan: FaultPlan, real: Any) -> None:
        self._backend, self._plan, self._real = backend, plan, real

    @property
    def written(self) -> int:
        return int(self._real.written)

    @property
    def recycled(self) -> bool:
        return bool(self._real.recycled)

    def view(self) -> Any:
        return self._real.view()

    def write(self, buf: Any) -> None:
        if _dead(self._plan, self._backend):
            self._real.abort()
            raise _err(
                "write", self._backend, "staging", errno.EIO, "the simulated process is dead"
            )
        self._real.write(buf)

    def abort(self) -> None:
        self._real.abort()

    def publish(self, path: str) -> int:
        plan, backend = self._plan, self._backend
        if plan.sabotage is not None:
            plan.sabotage("put", backend, path)
        fail = None
        if _dead(plan, backend):
            fail = (errno.EIO, "the simulated process is dead")
        elif plan.draw("enospc", "put", path):
            fail = (errno.ENOSPC, "injected")
        elif plan.draw("eio_write", "put", path):
            fail = (errno.EIO, "injected")
        if plan.draw("slow", "put", path):
            time.sleep(plan.rng("slow", path).uniform(0.001, 0.015))
        if fail is not None:
            self._real.abort()
            raise _err("write", backend, path, *fail)
        # like put's: a truncated file at a new final name (an existing file is only ever
        # replaced by a rename, which cannot tear it)
        if plan.draw("torn", "put", path) and not (backend.root / path).exists():
            tmp = backend.root / self._real.head / self._real.name
            data = tmp.read_bytes()
            self._real.abort()
            keep = plan.rng("torn", path).randrange(0, max(len(data), 1))
            dst = backend.root / path
            dst.parent.mkdir(parents=True, exist_ok=True)
            dst.write_bytes(data[:keep])
            plan.taint("torn", backend.root, path)
            raise _err("write", backend, path, errno.EIO, "injected torn write")
        n = int(self._real.publish(path))
        if path.startswith("chunks/") and n > 0 and plan.draw("bitflip", "put", path):
            flip_bit(backend.root / path, plan.rng("bitflip", path))
            plan.taint("bitflip", backend.root, path)
        return n


def _open_staged(self: LocalBackend, head: str, size: int | None = None) -> Any:
    plan = _plan_for(self)
    real = _ORIG["open_staged"](self, head, size)
    if plan is None:
        return real
    if _dead(plan, self):
        real.abort()
        raise _err("write", self, head, errno.EIO, "the simulated process is dead")
    return _FaultyStaged(self, plan, real)


def flip_bit(p: Path, rng: random.Random) -> None:
    data = bytearray(p.read_bytes())
    if not data:
        return
    i = rng.randrange(len(data))
    data[i] ^= 1 << rng.randrange(8)
    with open(p, "r+b") as f:
        f.write(data)


def damage_in_place(p: Path, rng: random.Random) -> str:
    """Change ``p``'s bytes in place, its size kept: one byte rewritten with ``pwrite``, or
    (when the file spans one and the filesystem can) a 4 KiB hole punched with
    ``fallocate(PUNCH_HOLE | KEEP_SIZE)``. Returns what was done."""
    size = p.stat().st_size
    if size == 0:
        return "empty: nothing done"
    fd = os.open(p, os.O_RDWR)
    try:
        if (
            size >= 8192
            and rng.random() < 0.4
            and _punch(fd, 4096 * rng.randrange(size // 4096 - 1))
        ):
            return "punched a 4 KiB hole"
        off = rng.randrange(size)
        (b,) = os.pread(fd, 1, off)
        os.pwrite(fd, bytes([b ^ (1 << rng.randrange(8))]), off)
        return f"flipped a bit of byte {off} with pwrite"
    finally:
        os.close(fd)


def _punch(fd: int, offset: int) -> bool:
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    punch_keep_size = 0x02 | 0x01  # FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE
    return libc.fallocate(fd, punch_keep_size, ctypes.c_long(offset), ctypes.c_long(4096)) == 0


def _reader(name: str) -> Any:
    def call(self: LocalBackend, path: str, *args: Any, **kw: Any) -> Any:
        plan = _plan_for(self)
        if plan is not None:
            if plan.sabotage is not None:
                plan.sabotage(name, self, path)
            if _dead(plan, self):
                raise _err("read", self, path, errno.EIO, "the simulated process is dead")
            if name in ("read", "read_into") and plan.draw("slow", name, path):
                time.sleep(plan.rng("slow", path).uniform(0.001, 0.01))
            if plan.draw("eio_list" if name == "list" else "eio_read", name, path):
                raise _err(name, self, path, errno.EIO, "injected")
        return _ORIG[name](self, path, *args, **kw)

    return call


def _delete(self: LocalBackend, path: str) -> None:
    plan = _plan_for(self)
    if plan is not None:
        if plan.sabotage is not None:
            plan.sabotage("delete", self, path)
        if _dead(plan, self) or plan.draw("eio_delete", "delete", path):
            return
    _ORIG["delete"](self, path)


def _sync_dirs(self: LocalBackend, dirs: Any) -> None:
    plan = _plan_for(self)
    if plan is not None:
        if plan.sabotage is not None:
            plan.sabotage("sync_dirs", self, ",".join(sorted(dirs)))
        if _dead(plan, self):
            raise _err("sync", self, "", errno.EIO, "the simulated process is dead")
        if self.fsync and plan.draw("eio_sync", "sync_dirs", ",".join(sorted(dirs))):
            raise _err("sync", self, ",".join(dirs), errno.EIO, "injected")
    _ORIG["sync_dirs"](self, dirs)


_WRAPPERS = {
    "__init__": _init,
    "put": _put,
    "open_staged": _open_staged,
    "read": _reader("read"),
    "read_into": _reader("read_into"),
    "exists": _reader("exists"),
    "size": _reader("size"),
    "map": _reader("map"),
    "list": _reader("list"),
    "delete": _delete,
    "sync_dirs": _sync_dirs,
}


@contextmanager
def install(plan: FaultPlan) -> Iterator[FaultPlan]:
    """Route every LocalBackend call under ``plan.scope`` through ``plan`` (one plan at a time)."""
    global _ACTIVE
    if _ACTIVE is not None:
        raise RuntimeError("a fault plan is already installed")
    for name, wrapper in _WRAPPERS.items():
        _ORIG[name] = getattr(LocalBackend, name)
        setattr(LocalBackend, name, wrapper)
    _ACTIVE = plan
    try:
        yield plan
    finally:
        _ACTIVE = None
        for name in _WRAPPERS:
            setattr(LocalBackend, name, _ORIG[name])
        _ORIG.clear()
