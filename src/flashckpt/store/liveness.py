"""Chunk liveness: the ONE owner of "which chunks of a tier may be deleted or trusted".

One :class:`Liveness` exists per tier root per process (every :class:`CheckpointStore` on the
same root shares it: ``store.liveness``). It knows

* the chunk set of every committed manifest and rank part, parsed once and cached by name
  (and on local tiers inode/size/mtime), updated by this process's commits and deletions;
* the chunks present in the tier (listed once, then kept up to date), so a save can reuse one;
* the pins of saves and promotions in flight: in memory for this process, and on disk under
  ``pins/`` (:mod:`flashckpt.store.pins`) for every other process, rank and ``flashckpt gc``;
* quarantine: a chunk found damaged is forgotten, so the next save writes it again, and its
  file is moved out of ``chunks/`` (:mod:`flashckpt.store.quarantine`);
* stamps (local tiers): which chunks' bytes this process wrote or verified by hashing, and
  their file's :data:`FileKey` then. A chunk is reused only while its file still shows that
  stamp: bytes changed in place (a flipped byte, a punched hole, a damaged zstd frame) change
  its mtime and ctime, and the next save writes it again. Bit rot that leaves the metadata
  alone is what the scrub finds (:mod:`flashckpt.store.scrub`).
* the codecs the tier's chunks were seen or written in (gc looks for a chunk's file in those).

Garbage collection (:mod:`flashckpt.store.gc`) asks it what is live; nobody else deletes
chunks. The store never starts a thread; every method here is synchronous and thread-safe.

The contract, in the order a writer uses it (a save; a promotion copying into this tier)::

    win = store.liveness.open_window(kind="save", step=step)
        # 1. holds ROOT/locks/root.lock SHARED (waits while another process collects) and
        #    writes pins/<host>-<pid>-<n>.json naming the owner
    ref = win.claim(h, size)
        # 2. for every chunk the save will name, BEFORE deciding: pins h, then returns the
        #    stored ChunkRef to reuse (see find) or None: the caller must write h
        #    (store.put_chunk) before committing
    store.commit(manifest, ...)           # 3. the manifest (or rank part) names the chunks
    win.committed()                       # 4. drop the pins, release the lock, remove the pin
    # or, on any failure before 4:
    win.failed()                          # 4'. its claimed chunks become gc candidates (in
                                          #     the pin file too); then gc.collect_garbage

A queued promotion keeps its source step's chunks with ``pin = liveness.pin(hashes, ...)``
(in memory and in a pin file, without the lock) and ``pin.release()`` when done or dropped.
Readers need no lock: a reader that finds a chunk missing asks :meth:`Liveness.still_listed`
before calling the step damaged (retention may have deleted it meanwhile); a reader that finds
a chunk's bytes wrong calls :meth:`Liveness.quarantine` (the store's read methods do this).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import stat
import threading
import time
import weakref
from collections import Counter
from collections.abc import Iterable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path

from flashckpt.errors import FlashCkptError
from flashckpt.store.files import safeopen
from flashckpt.store.files.backend import Backend
from flashckpt.store.format.manifest import ChunkRef, Manifest
from flashckpt.store.format.names import (
    chunk_path,
    parse_chunk_name,
    parse_part_name,
    parse_step_name,
    step_name,
)
from flashckpt.store.format.parse import parse_manifest
from flashckpt.store.lock import RootLock
from flashckpt.store.pins import Pin, Window
from flashckpt.store.quarantine import move_away, still_damaged

log = logging.getLogger(__name__)

_registry: weakref.WeakValueDictionary[str, Liveness] = weakref.WeakValueDictionary()
_registry_lock = threading.Lock()

FileKey = tuple[int, int, int, int]
"""What a chunk file's lstat says of its bytes: (st_ino, st_size, st_mtime_ns, st_ctime_ns).
A write, a punched hole or a replacement changes it (mtime/ctime; on kernels before 6.13 only
to a clock tick's resolution: damage within the tick of the last write is left to the scrub)."""


@dataclass(frozen=True)
class Stamp:
    """A chunk's bytes were written or verified by this process when its file showed ``key``."""

    key: FileKey
    size: int  # raw bytes
    codec: str
    at: float  # time.monotonic() of the write or verification (the scrub's order)


def file_key(st: os.stat_result) -> FileKey:
    return (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def liveness_for(backend: Backend) -> Liveness:
    """The process's Liveness of ``backend``'s root (shared by every store on that root)."""
    with _registry_lock:
        live = _registry.get(backend.url)
        if live is None:
            live = Liveness(backend)
            _registry[backend.url] = live
        return live


class Liveness:
    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        root = getattr(backend, "root", None)
        self.root: Path | None = Path(root) if backend.is_local and root is not None else None
        self.lock = RootLock(self.root) if self.root is not None else None
        self.mutex = threading.RLock()
        self._manifests: dict[str, tuple[object, frozenset[str]]] = {}
        self._refcount: Counter[str] = Counter()
        self._refs: dict[str, ChunkRef] = {}  # one ChunkRef per referenced hash (sizes)
        self._index: dict[str, ChunkRef] | None = None
        self._pins: Counter[str] = Counter()  # this process's windows and promotion pins
        self._writing: Counter[str] = Counter()  # claimed by an open window for writing
        self.candidates: set[str] = set()  # may have become garbage since the last collection
        self.quarantined: set[str] = set()
        self._stamps: dict[str, Stamp] = {}  # local tiers only: see find()
        self.codecs: set[str] = set()  # every codec a chunk of this tier was seen or written in
        self.synced = False  # every listed manifest parsed at least once
        # local tiers: pins on disk, and the first collection sweeps every chunk file (orphans
        # of processes that died). A remote tier has one writer, the promoter of the job that
        # owns it: pins stay in memory and listing a bucket is never done behind one's back.
        self.pins_on_disk = self.root is not None
        self.needs_full = self.root is not None

    # -- the chunk index ----------------------------------------------------------------
    def index(self) -> dict[str, ChunkRef]:
        """Chunks this tier holds: listed once, then kept up to date by this process."""
        with self.mutex:
            if self._index is None:
                known: dict[str, ChunkRef] = {}
                for sub in self.backend.list("chunks"):
                    for name in self.backend.list(f"chunks/{sub}"):
                        parsed = parse_chunk_name(name)
                        if parsed is not None:
                            known[parsed[0]] = ChunkRef(hash=parsed[0], size=-1, codec=parsed[1])
                            self.codecs.add(parsed[1])
                self._index = known
            return self._index

    def find(self, h: str, size: int | None = None) -> ChunkRef | None:
        """The stored chunk ``h`` if it may be reused, else None: write it.

        Local tiers: present, not quarantined, and its file (lstat through the gateway) shows
        the stamp this process recorded when it wrote the chunk or last verified its bytes by
        hashing (:meth:`added`, :meth:`verified`). A chunk without a stamp, or whose file
        changed since, is written again by the caller, which holds its bytes (hashed): that
        costs about what reading and hashing the stored copy would, reads nothing under this
        mutex, and replaces a damaged copy without deciding whether it is damaged.

        Remote tiers (fsspec, no root): present is enough. An object is replaced whole or not
        at all, has no inode or ctime to stamp, and their reads verify every chunk."""
        with self.mutex:
            ref = None if h in self.quarantined else self.index().get(h)
            if ref is None or self.root is None:
                return ref
            stamp = self._stamps.get(h)
            if stamp is None or (size is not None and size != stamp.size):
                return None
            try:
                st: os.stat_result | None = safeopen.lstat_in(self.root, chunk_path(h, stamp.codec))
            except (OSError, FlashCkptError):
                st = None
            if st is None or not stat.S_ISREG(st.st_mode) or file_key(st) != stamp.key:
                del self._stamps[h]  # changed (or gone) since verified: the caller rewrites it
                if st is None:
                    self.index().pop(h, None)
                return None
            return ChunkRef(hash=h, size=stamp.size, codec=stamp.codec, stored_size=st.st_size)

    # -- stamps (local tiers) -----------------------------------------------------------------
    def before_read(self, ref: ChunkRef, st: os.stat_result | None = None) -> FileKey | None:
        """The key of ``ref``'s file before a verifying read (taken first: a change during or
        after the read then shows as a different key); None on remote tiers or when the file
        cannot be stat'ed (the read reports it). ``st``: the reader's own fstat, if it has one."""
        if self.root is None:
            return None
        if st is not None:
            return file_key(st)
        try:
            return file_key(safeopen.lstat_in(self.root, chunk_path(ref.hash, ref.codec)))
        except (OSError, FlashCkptError):
            return None

    def verified(self, ref: ChunkRef, key: FileKey | None) -> None:
        """``ref``'s bytes were read and matched its hash; ``key`` is :meth:`before_read`'s."""
        if key is None:
            return
        with self.mutex:
            if ref.hash in self.quarantined:
                return
            self._stamp(ref, key)
            stored = dataclasses.replace(ref, stored_size=key[1])
            self.index().setdefault(ref.hash, stored)

    def quarantined_set(self) -> set[str]:
        with self.mutex:
            return set(self.quarantined)

    def verified_times(self) -> dict[str, float]:
        """When each stamped chunk's bytes were last written or verified (time.monotonic())."""
        with self.mutex:
            return {h: st.at for h, st in self._stamps.items()}

    def added(self, ref: ChunkRef, st: os.stat_result | None = None) -> None:
        """This process wrote ``ref`` (the bytes it hashed): stamp it (``st``: see before_read)."""
        key = self.before_read(ref, st)
        with self.mutex:
            self.index()[ref.hash] = ref
            self.quarantined.discard(ref.hash)
            if key is not None:
                self._stamp(ref, key)

    def writing(self, codec: str) -> None:
        """A chunk is about to be written in ``codec`` (:meth:`chunk_paths` must name it)."""
        with self.mutex:
            self.codecs.add(codec)

    def chunk_paths(self, h: str) -> list[str]:
        """The files chunk ``h`` may have here, for gc: one per codec a chunk of this tier was
        listed, named by a manifest, or written in. Another codec's file would be an orphan of
        another process: the full sweep (a process's first, or after a dead pin) finds it."""
        with self.mutex:
            return [chunk_path(h, c) for c in sorted(self.codecs)]

    def _stamp(self, ref: ChunkRef, key: FileKey) -> None:
        self._stamps[ref.hash] = Stamp(key=key, size=ref.size, codec=ref.codec, at=time.monotonic())

    def forget(self, h: str) -> None:
        with self.mutex:
            self._stamps.pop(h, None)
            if self._index is not None:
                self._index.pop(h, None)

    # -- manifests ----------------------------------------------------------------------
    def sync(self) -> None:
        """Bring the manifest cache up to date with ``steps/``: parse only new or changed
        names, drop vanished ones. Raises on any read or parse error (callers fail closed)."""
        with self.mutex:
            names = {
                f"steps/{n}"
                for n in self.backend.list("steps")
                if parse_step_name(n) is not None or parse_part_name(n) is not None
            }
            for gone in set(self._manifests) - names:
                self._drop(gone)
            for name in sorted(names):
                version = self._version(name)
                cached = self._manifests.get(name)
                if cached is not None and (version is None or cached[0] == version):
                    continue
                try:
                    data = self.backend.read(name)
                except FileNotFoundError:
                    self._drop(name)  # deleted between list and read
                    continue
                m = parse_manifest(data, where=f"{self.backend.url}/{name}")
                self._set(name, version, m.chunks)
            self.synced = True

    def on_commit(self, name: str, manifest: Manifest) -> None:
        with self.mutex:
            self._set(name, self._version(name), manifest.chunks)

    def on_delete(self, name: str) -> None:
        with self.mutex:
            if name not in self._manifests:
                self.needs_full = True  # chunks of a manifest never parsed: sweep to find them
            self._drop(name)

    def referenced(self) -> set[str]:
        with self.mutex:
            return set(self._refcount)

    def referenced_refs(self) -> dict[str, ChunkRef]:
        """Every chunk a committed manifest or rank part names (as of the last sync)."""
        with self.mutex:
            return {h: self._refs[h] for h in self._refcount if h in self._refs}

    def steps_naming(self, h: str) -> list[int]:
        """The steps whose manifest (or rank part) names chunk ``h`` (as of the last sync)."""
        with self.mutex:
            names = [n for n, (_, hashes) in self._manifests.items() if h in hashes]
        steps: set[int] = set()
        for n in names:
            base = n.rpartition("/")[2]
            part = parse_part_name(base)
            step = part[0] if part is not None else parse_step_name(base)
            if step is not None:
                steps.add(step)
        return sorted(steps)

    def still_listed(self, step: int) -> bool:
        """For lock-free readers: is ``step`` still committed? (False: retention deleted it
        while it was being read, which is not damage.)"""
        try:
            if self.root is None:
                return self.backend.exists(step_name(step))
            # any entry at the name counts: a FIFO or a link planted there is damage, not gone
            safeopen.lstat_in(self.root, step_name(step))
            return True
        except FileNotFoundError:
            return False
        except (OSError, FlashCkptError):
            return True  # cannot tell: keep reporting what was found

    def _version(self, name: str) -> object:
        if self.root is None:
            return None
        try:
            st = os.stat(self.root / name)
        except OSError:
            return None
        return (st.st_ino, st.st_size, st.st_mtime_ns)

    def _set(self, name: str, version: object, chunks: Iterable[ChunkRef]) -> None:
        self._drop(name)
        refs = {c.hash: c for c in chunks}
        self.codecs.update(c.codec for c in refs.values())
        self._manifests[name] = (version, frozenset(refs))
        for h, c in refs.items():
            self._refcount[h] += 1
            if h not in self._refs or self._refs[h].stored_size <= 0:
                self._refs[h] = c

    def _drop(self, name: str) -> None:
        old = self._manifests.pop(name, None)
        if old is None:
            return
        for h in old[1]:
            self._refcount[h] -= 1
            if self._refcount[h] <= 0:
                del self._refcount[h]
                self._refs.pop(h, None)
                self.candidates.add(h)

    # -- pins ---------------------------------------------------------------------------
    def open_window(self, *, kind: str, step: int | None) -> Window:
        """A save or promotion into this tier begins (module docstring, steps 1-4)."""
        return Window(self, kind=kind, step=step)

    def pin(self, hashes: Iterable[str], *, kind: str, step: int | None) -> Pin:
        """Keep ``hashes`` alive without the root lock (a queued promotion's source step)."""
        return Pin(self, set(hashes), kind=kind, step=step)

    def pinned(self) -> set[str]:
        with self.mutex:
            return set(self._pins)

    def _pin(self, hashes: Iterable[str], delta: int) -> None:
        for h in hashes:
            self._pins[h] += delta
            if self._pins[h] <= 0:
                del self._pins[h]
                if h not in self._refcount:
                    self.candidates.add(h)

    def has_garbage(self) -> bool:
        """Is a collection worth running (candidates, or a full sweep due)?"""
        with self.mutex:
            return self.needs_full or any(h not in self._refcount for h in self.candidates)

    @contextmanager
    def exclusive(self) -> Iterator[bool]:
        """The root lock exclusively (non-blocking) for a collection; remote tiers have no
        lock (one process writes them: its promoter), so this is always granted there."""
        with self.mutex:
            with self.lock.exclusive() if self.lock is not None else nullcontext(True) as got:
                yield got

    # -- quarantine -------------------------------------------------------------------------
    def quarantine(self, ref: ChunkRef, *, reason: str) -> bool:
        """``ref``'s bytes were found damaged: forget it here (no save reuses it) and move the
        file out of ``chunks/`` (remote tiers: delete it) after checking once more that it
        is damaged. True when it was moved. Never raises; callers journal the damage."""
        with self.mutex:
            self.forget(ref.hash)
            self.quarantined.add(ref.hash)
            if self._writing[ref.hash] > 0:
                return False  # a save of this process is writing a good copy over it
            path = chunk_path(ref.hash, ref.codec)
            try:
                if not still_damaged(self.backend, ref, path):
                    self.quarantined.discard(ref.hash)
                    return False
                move_away(self.backend, self.root, path)
            except (OSError, FlashCkptError) as exc:
                log.warning("could not quarantine chunk %s (%s): %s", ref.hash, reason, exc)
                return False
        log.warning("quarantined damaged chunk %s of %s: %s", ref.hash, self.backend.url, reason)
        return True
