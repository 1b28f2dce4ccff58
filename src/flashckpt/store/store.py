"""The checkpoint store: content-addressed chunks + one manifest per committed step.

Layout under a backend's root::

    chunks/ab/abcdef...        immutable chunk, raw bytes (``.zst`` suffix when compressed)
    steps/000000001000.json    manifest; the checkpoint exists iff this file exists
    steps/000000001000.rank-3.json   a rank's part before the global commit (distributed)

Synchronous and thread-free: the engine decides what runs where. Every method is safe to call
from several worker threads at once except :meth:`commit` and :meth:`delete_step`, which the
engine calls from one thread.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from typing import Any

from flashckpt.errors import CorruptCheckpointError, ManifestError, NoCheckpointError, StorageError
from flashckpt.store.files.backend import Backend, Buffer, StagedFile
from flashckpt.store.files.staged import Pages
from flashckpt.store.format import codec as codecs
from flashckpt.store.format.manifest import ChunkRef, Manifest
from flashckpt.store.format.names import (
    PART_RE,
    STEP_RE,
    chunk_path,
    parse_part_name,
    parse_step_name,
    part_name,
    step_name,
    stray_step_names,
)
from flashckpt.store.format.parse import parse_manifest
from flashckpt.store.liveness import Liveness, liveness_for

log = logging.getLogger(__name__)

__all__ = ["PART_RE", "STEP_RE", "CheckpointStore", "chunk_path", "part_name", "step_name"]

STAGING_DIR = "staging"
"""Where chunks are written before their name is known (:meth:`CheckpointStore.stage_chunk`);
the staging arena of a memory tier lives there too (engine/tiers/arena.py)."""


def maps_chunks(store: CheckpointStore) -> bool:
    """Whether ``store``'s chunks are read by mapping them (the memory tier: restore and
    promotion read its pages where they are)."""
    backend = store.backend
    return bool(getattr(backend, "in_memory", False)) and callable(getattr(backend, "map", None))


class CheckpointStore:
    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self._live: Liveness | None = None

    @property
    def url(self) -> str:
        return self.backend.url

    @property
    def liveness(self) -> Liveness:
        """Who may delete or reuse which chunk of this tier (shared by every store on it)."""
        if self._live is None:
            self._live = liveness_for(self.backend)
        return self._live

    # -- chunks ---------------------------------------------------------------------------
    def find_chunk(self, h: str, *, size: int | None = None) -> ChunkRef | None:
        """The stored chunk with raw hash ``h`` if it may be reused (present, not quarantined,
        its bytes written or verified since they last changed: Liveness.find), else None.
        A save in flight must pin it first: ``Window.claim`` (:mod:`flashckpt.store.liveness`)
        does both."""
        return self.liveness.find(h, size)

    def put_chunk(self, h: str, size: int, parts: Sequence[Buffer], codec: str) -> ChunkRef:
        """Store a chunk (idempotent). Returns its reference, with the stored size."""
        stored = codecs.encode(parts, codec)
        stored_codec = codec if codec == "raw" or len(stored[0]) < size else "raw"
        if stored_codec == "raw" and codec != "raw":
            stored = list(parts)  # incompressible: keep it raw
        self.liveness.writing(stored_codec)
        path = chunk_path(h, stored_codec)
        n = self.backend.put(path, stored)
        ref = ChunkRef(hash=h, size=size, codec=stored_codec, stored_size=n)
        self.liveness.added(ref, self._last_stat(path))
        return ref

    @property
    def stage_chunk_supported(self) -> bool:
        return hasattr(self.backend, "open_staged")

    def stage_chunk(self, size: int | None = None) -> StagedChunk | None:
        """A chunk written as its bytes arrive and named when they are all there (its hash is
        computed by the writer on the way), or None when the backend cannot (remote). With its
        ``size``, into a recycled file of that size when the backend keeps one."""
        open_staged = getattr(self.backend, "open_staged", None)
        if open_staged is None:
            return None
        return StagedChunk(self, open_staged(STAGING_DIR, size))

    def forget_chunk(self, h: str) -> None:
        self.liveness.forget(h)

    def _damaged(self, ref: ChunkRef, exc: CorruptCheckpointError) -> CorruptCheckpointError:
        """Quarantine a chunk whose bytes are wrong; the error to raise says so."""
        if self.liveness.quarantine(ref, reason=str(exc)):
            return CorruptCheckpointError(
                f"{exc}; it was moved to {self.url}/quarantine/ and the next save writes it again",
                step=exc.step,
                key=exc.key,
                chunk=exc.chunk,
            )
        return exc

    def read_chunk(
        self, ref: ChunkRef, *, step: int | None = None, key: str | None = None
    ) -> bytes:
        """Raw bytes of a chunk, verified against its hash (then stamped for reuse)."""
        seen = self.liveness.before_read(ref)
        try:
            stored = self.backend.read(chunk_path(ref.hash, ref.codec))
        except FileNotFoundError:
            raise _missing(ref, step, key) from None
        try:
            raw = codecs.decode(stored, ref.codec, ref.size, chunk=ref.hash)
            self._check(ref, raw, step=step, key=key)
        except CorruptCheckpointError as exc:
            raise self._damaged(ref, exc) from None
        self.liveness.verified(ref, seen)
        return raw

    def read_chunk_into(
        self, ref: ChunkRef, out: memoryview, *, step: int | None = None, key: str | None = None
    ) -> None:
        """Read a raw chunk straight into ``out`` (exactly ``ref.size`` bytes) and verify it:
        one pass, each cache-sized piece hashed right after it is read (``out`` is the
        caller's: a damaged chunk has already written there when this raises)."""
        seen = self.liveness.before_read(ref)
        digest = codecs.hasher()
        try:
            n = self.backend.read_into(chunk_path(ref.hash, "raw"), out, each=digest.update)
        except FileNotFoundError:
            raise _missing(ref, step, key) from None
        try:
            if n != ref.size:
                raise CorruptCheckpointError(
                    f"chunk {ref.hash} is truncated: {n} of {ref.size} bytes (tensor {key!r}, "
                    f"step {step})",
                    step=step,
                    key=key,
                    chunk=ref.hash,
                )
            if digest.hexdigest() != ref.hash:
                raise _mismatch(ref, step, key)
        except CorruptCheckpointError as exc:
            raise self._damaged(ref, exc) from None
        self.liveness.verified(ref, seen)

    def map_chunk(
        self, ref: ChunkRef, *, step: int | None = None, key: str | None = None
    ) -> Buffer:
        """A raw chunk's bytes mapped from the backend (``backend.map``: the memory tier),
        verified against its hash before this returns; nothing is copied. Damage (missing,
        truncated, wrong bytes, not a regular file) raises CorruptCheckpointError like
        :meth:`read_chunk`, with the chunk quarantined."""
        path = chunk_path(ref.hash, "raw")
        try:
            mapped = self.backend.map(path)  # type: ignore[attr-defined]
        except FileNotFoundError:
            raise _missing(ref, step, key) from None
        # the key of the file mapped, taken before its bytes are hashed (liveness.verified)
        seen = self.liveness.before_read(ref, self._last_stat(path))
        raw = b"" if mapped is None else mapped
        try:
            self._check(ref, raw, step=step, key=key)  # a wrong length fails here too
        except CorruptCheckpointError as exc:
            raise self._damaged(ref, exc) from None
        self.liveness.verified(ref, seen)
        return raw

    def _last_stat(self, path: str) -> os.stat_result | None:
        """The backend's fstat of the file its last put or map in this thread opened at
        ``path`` (``LocalBackend.last_stat``), or None: then the caller stats by path."""
        last_stat = getattr(self.backend, "last_stat", None)
        return last_stat(path) if last_stat is not None else None

    @staticmethod
    def _check(ref: ChunkRef, raw: Buffer, *, step: int | None, key: str | None) -> None:
        if len(raw) != ref.size or codecs.hash_parts([raw]) != ref.hash:
            raise _mismatch(ref, step, key)

    def chunk_dirs(self, hashes: Sequence[str]) -> list[str]:
        return sorted({f"chunks/{h[:2]}" for h in hashes})

    # -- manifests ------------------------------------------------------------------------
    def commit(
        self, manifest: Manifest, *, chunk_dirs: Sequence[str], name: str | None = None
    ) -> None:
        """Make a checkpoint exist: sync chunk directories, then write the manifest last. If the
        manifest's rename cannot be made durable (the fsync of ``steps/`` fails), the manifest
        is removed again before the error propagates: a save that raised never leaves a
        checkpoint behind (it could vanish at the next power loss, or be trusted by a restore
        the caller was told cannot happen); so is a manifest whose write failed."""
        self.backend.sync_dirs(list(chunk_dirs))
        path = name or step_name(manifest.step)
        try:
            self.backend.put(path, [manifest.to_json()])
        except BaseException:
            # a write that failed may still have left a (torn) file at the final name on a
            # filesystem that tore the rename's target: the save raised, so no manifest of it
            # may stay behind to be restored or to stop gc as damage
            try:
                self.backend.delete(path)
            except (OSError, StorageError) as exc:
                log.warning("could not remove the failed manifest %s: %s", path, exc)
            raise
        try:
            self.backend.sync_dirs(["steps"])
        except BaseException:
            self.backend.delete(path)
            raise
        self.liveness.on_commit(path, manifest)

    def steps(self) -> list[int]:
        out = []
        for n in self.backend.list("steps"):
            step = parse_step_name(n)  # the one parser: a non-canonical name is no step
            if step is not None:
                out.append(step)
        return sorted(out)

    def stray_names(self) -> list[str]:
        """Files in ``steps/`` under no canonical name (planted or foreign): never a step."""
        return stray_step_names(self.backend.list("steps"))

    def load_manifest(self, step: int, *, name: str | None = None) -> Manifest:
        path = name or step_name(step)
        try:
            data = self.backend.read(path)
        except FileNotFoundError:
            raise NoCheckpointError(f"no checkpoint for step {step} in {self.url}") from None
        m = parse_manifest(data, where=f"{self.url}/{path}", whole=name is None)
        if name is None and m.step != step:
            raise ManifestError(f"{path} claims step {m.step}", step=step)
        return m

    def delete_step(self, step: int) -> None:
        """Delete a manifest (retention); its chunks become gc candidates."""
        self.backend.delete(step_name(step))
        self.liveness.on_delete(step_name(step))

    def has_step(self, step: int) -> bool:
        """Is ``step`` still committed? Readers ask before calling a missing chunk damage."""
        return self.liveness.still_listed(step)

    def part_names(self) -> list[str]:
        return [n for n in self.backend.list("steps") if parse_part_name(n) is not None]


def _mismatch(ref: ChunkRef, step: int | None, key: str | None) -> CorruptCheckpointError:
    return CorruptCheckpointError(
        f"chunk {ref.hash} is damaged: its content does not match its hash "
        f"(tensor {key!r}, step {step}); it will not be loaded",
        step=step,
        key=key,
        chunk=ref.hash,
    )


def _missing(ref: ChunkRef, step: int | None, key: str | None) -> CorruptCheckpointError:
    """The error for a chunk a manifest names that is not in the store."""
    where = f" (tensor {key!r}, step {step})" if key else ""
    return CorruptCheckpointError(
        f"chunk {ref.hash} is missing{where}", step=step, key=key, chunk=ref.hash
    )


class StagedChunk:
    """A raw chunk being written in one pass (:meth:`CheckpointStore.stage_chunk`): ``write``
    its bytes, then ``publish(h, size)`` under its hash, or ``abort``. Until published it is a
    temporary file that no reader or gc takes for a chunk (a dead writer's is swept by gc)."""

    def __init__(self, store: CheckpointStore, f: StagedFile) -> None:
        self.store, self._f = store, f

    @property
    def recycled(self) -> bool:
        """Written into the resident pages of a recycled file (``view`` can read them back)."""
        return bool(getattr(self._f, "recycled", False))

    def view(self) -> Buffer:
        """The bytes written so far, read from the mapped recycled file (no copy)."""
        return self._f.view()

    def write(self, buf: Buffer) -> None:
        self._f.write(buf)

    def fill(self, views: list[Any], copy: Callable[[Any, list[Any]], object]) -> None:
        """Write ``views`` in order; a recycled file's with one ``copy(destination, views)``."""
        self._f.fill(views, copy)

    def keep_pages(self) -> Pages | None:
        """Keep a recycled file's pages mapped past :meth:`publish` (StagedFile.keep_pages)."""
        keep = getattr(self._f, "keep_pages", None)
        return keep() if keep is not None else None

    def publish(self, h: str, size: int) -> ChunkRef:
        if self._f.written != size:
            self._f.abort()
            raise StorageError(
                f"staged chunk {h}: {self._f.written} bytes written, {size} expected (internal)"
            )
        self.store.liveness.writing("raw")
        n = self._f.publish(chunk_path(h, "raw"))
        ref = ChunkRef(hash=h, size=size, codec="raw", stored_size=n)
        self.store.liveness.added(ref, getattr(self._f, "published_stat", None))
        return ref

    def abort(self) -> None:
        self._f.abort()
