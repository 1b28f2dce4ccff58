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
import re
import threading
from collections.abc import Sequence

from flashckpt.errors import CorruptCheckpointError, ManifestError, NoCheckpointError
from flashckpt.store import codec as codecs
from flashckpt.store.backend import Backend, Buffer
from flashckpt.store.manifest import HASH_RE, ChunkRef, Manifest, parse_manifest

log = logging.getLogger(__name__)

STEP_RE = re.compile(r"^(\d{1,15})\.json$")
PART_RE = re.compile(r"^(\d{1,15})\.rank-(\d{1,8})\.json$")


def step_name(step: int) -> str:
    return f"steps/{step:012d}.json"


def part_name(step: int, rank: int) -> str:
    return f"steps/{step:012d}.rank-{rank}.json"


_SUFFIX = {
    "raw": "",
    "zstd": ".zst",
    "zstd+shuf2": ".zs2",
    "zstd+shuf4": ".zs4",
    "zstd+shuf8": ".zs8",
}
_CODEC_OF = {v.lstrip("."): k for k, v in _SUFFIX.items()}


def chunk_path(h: str, codec: str) -> str:
    """``chunks/ab/<hash>`` plus a suffix naming the codec (the name never comes from keys)."""
    if not HASH_RE.match(h) or codec not in _SUFFIX:
        raise CorruptCheckpointError(f"invalid chunk name {h!r} / codec {codec!r}", chunk=h)
    return f"chunks/{h[:2]}/{h}{_SUFFIX[codec]}"


class CheckpointStore:
    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self._known: dict[str, ChunkRef] | None = None
        self._lock = threading.RLock()

    @property
    def url(self) -> str:
        return self.backend.url

    # -- chunks ---------------------------------------------------------------------------
    def _index(self) -> dict[str, ChunkRef]:
        """Chunks this tier holds: listed once, then kept up to date by this process."""
        with self._lock:
            if self._known is None:
                known: dict[str, ChunkRef] = {}
                for sub in self.backend.list("chunks"):
                    for name in self.backend.list(f"chunks/{sub}"):
                        h, _, ext = name.partition(".")
                        if HASH_RE.match(h) and ext in _CODEC_OF:
                            known[h] = ChunkRef(hash=h, size=-1, codec=_CODEC_OF[ext])
                self._known = known
            return self._known

    def find_chunk(self, h: str) -> ChunkRef | None:
        """The stored chunk with raw hash ``h``, or None. Local tiers confirm with a stat so a
        chunk deleted behind our back is never reused."""
        ref = self._index().get(h)
        if ref is None:
            return None
        if self.backend.is_local and not self.backend.exists(chunk_path(h, ref.codec)):
            with self._lock:
                self._index().pop(h, None)
            return None
        return ref

    def put_chunk(self, h: str, size: int, parts: Sequence[Buffer], codec: str) -> ChunkRef:
        """Store a chunk (idempotent). Returns its reference, with the stored size."""
        stored = codecs.encode(parts, codec)
        stored_codec = codec if codec == "raw" or len(stored[0]) < size else "raw"
        if stored_codec == "raw" and codec != "raw":
            stored = list(parts)  # incompressible: keep it raw
        n = self.backend.put(chunk_path(h, stored_codec), stored)
        ref = ChunkRef(hash=h, size=size, codec=stored_codec, stored_size=n)
        with self._lock:
            self._index()[h] = ref
        return ref

    def forget_chunk(self, h: str) -> None:
        with self._lock:
            if self._known is not None:
                self._known.pop(h, None)

    def read_chunk(
        self, ref: ChunkRef, *, step: int | None = None, key: str | None = None
    ) -> bytes:
        """Raw bytes of a chunk, verified against its hash."""
        where = f" (tensor {key!r}, step {step})" if key else ""
        try:
            stored = self.backend.read(chunk_path(ref.hash, ref.codec))
        except FileNotFoundError:
            raise CorruptCheckpointError(
                f"chunk {ref.hash} is missing{where}", step=step, key=key, chunk=ref.hash
            ) from None
        raw = codecs.decode(stored, ref.codec, ref.size, chunk=ref.hash)
        self._check(ref, raw, step=step, key=key)
        return raw

    def read_chunk_into(
        self, ref: ChunkRef, out: memoryview, *, step: int | None = None, key: str | None = None
    ) -> None:
        """Read a raw chunk straight into ``out`` (exactly ``ref.size`` bytes) and verify it."""
        try:
            n = self.backend.read_into(chunk_path(ref.hash, "raw"), out)
        except FileNotFoundError:
            raise CorruptCheckpointError(
                f"chunk {ref.hash} is missing (tensor {key!r}, step {step})",
                step=step,
                key=key,
                chunk=ref.hash,
            ) from None
        if n != ref.size:
            raise CorruptCheckpointError(
                f"chunk {ref.hash} is truncated: {n} of {ref.size} bytes (tensor {key!r}, "
                f"step {step})",
                step=step,
                key=key,
                chunk=ref.hash,
            )
        self._check(ref, out, step=step, key=key)

    @staticmethod
    def _check(ref: ChunkRef, raw: Buffer, *, step: int | None, key: str | None) -> None:
        if len(raw) != ref.size or codecs.hash_parts([raw]) != ref.hash:
            raise CorruptCheckpointError(
                f"chunk {ref.hash} is damaged: its content does not match its hash "
                f"(tensor {key!r}, step {step}); it will not be loaded",
                step=step,
                key=key,
                chunk=ref.hash,
            )

    def chunk_dirs(self, hashes: Sequence[str]) -> list[str]:
        return sorted({f"chunks/{h[:2]}" for h in hashes})

    # -- manifests ------------------------------------------------------------------------
    def commit(
        self, manifest: Manifest, *, chunk_dirs: Sequence[str], name: str | None = None
    ) -> None:
        """Make a checkpoint exist: sync chunk directories, then write the manifest last."""
        self.backend.sync_dirs(list(chunk_dirs))
        self.backend.put(name or step_name(manifest.step), [manifest.to_json()])
        self.backend.sync_dirs(["steps"])

    def steps(self) -> list[int]:
        out = []
        for n in self.backend.list("steps"):
            m = STEP_RE.match(n)
            if m:
                out.append(int(m.group(1)))
        return sorted(out)

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
        self.backend.delete(step_name(step))

    def part_names(self) -> list[str]:
        return [n for n in self.backend.list("steps") if PART_RE.match(n)]
