"""The scrub: find damaged chunks before a restore needs them, a bounded amount at a time.

A chunk's stamp (:mod:`flashckpt.store.liveness`) catches bytes changed through the filesystem
(their mtime and ctime change), so no save reuses them. Bit rot, a bad sector, or a writer that
put the timestamps back leaves the metadata alone: only reading the bytes finds that. The
scrub re-reads and re-hashes the chunks that committed manifests (and rank parts) name, those
verified longest ago first (a chunk just written or restored is stamped now, so it goes last;
a full pass is a round robin), at most about ``budget_bytes`` per :meth:`Scrubber.step`.

A good chunk is stamped again (the store's verifying read does it); a damaged one is
quarantined by that same read (:meth:`Liveness.quarantine`: moved out of ``chunks/``), so
the next save of a state holding those bytes writes them again, and the steps that named it
fall back at restore instead of spreading it by promotion. A chunk missing because retention
deleted its last step meanwhile is not damage, nor is an I/O error (tried again next pass),
nor a chunk absent from a tier that holds only some of its steps' chunks (``partial``: a
node-local memory tier under peer replication holds its node's chunks and replicas).
Each step returns what it found; the caller journals and logs it.

Synchronous and stateful (the store never starts a thread): the engine calls :meth:`step`
from a thread it owns, in idle time, paced by ``scrub_bytes_per_s``
(:mod:`flashckpt.engine.tiers.scrubbing`).
"""

from __future__ import annotations

import logging
import mmap
import time
from dataclasses import dataclass, field

from flashckpt.errors import ConfigError, CorruptCheckpointError, FlashCkptError, StorageError
from flashckpt.store.format.manifest import ChunkRef
from flashckpt.store.store import CheckpointStore, maps_chunks

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class ScrubDamage:
    chunk: str
    steps: tuple[int, ...]  # the committed steps (or parts) that name it
    error: str
    # no save reuses it, and it was moved to quarantine/ (unless a save of this process was
    # writing a good copy over it); False: it is missing
    quarantined: bool


@dataclass(kw_only=True)
class ScrubResult:
    checked: int = 0  # chunks read and hashed
    bytes: int = 0  # bytes at rest read
    damaged: list[ScrubDamage] = field(default_factory=list)


class Scrubber:
    """A cursor over one tier's committed chunks (see the module docstring). Not thread-safe:
    one caller steps it."""

    def __init__(self, store: CheckpointStore, *, partial: bool = False) -> None:
        self.store = store
        # the tier holds only some chunks of its steps (a node-local memory tier under peer
        # replication: its node's chunks and replicas): a chunk absent there is not damage
        self.partial = partial
        self._tried: dict[str, float] = {}  # hash -> when this scrubber last read it
        self._reported: set[str] = set()  # damage already returned once (not again each pass)

    def step(self, budget_bytes: int) -> ScrubResult:
        """Read and verify the chunks verified longest ago until ``budget_bytes`` (at rest)
        were read; at least one chunk when there is any. Raises FlashCkptError when the
        committed manifests cannot be read (nothing is checked then)."""
        if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes < 1:
            raise ConfigError(f"Scrubber.step needs budget_bytes >= 1, got {budget_bytes!r}")
        live = self.store.liveness
        live.sync()
        # a quarantined chunk is out of the tier and was reported when it was quarantined
        gone = live.quarantined_set()
        refs = {h: r for h, r in live.referenced_refs().items() if h not in gone}
        self._reported &= set(refs)
        self._tried = {h: t for h, t in self._tried.items() if h in refs}
        stamped = live.verified_times()
        never = float("-inf")

        def last(h: str) -> float:
            return max(stamped.get(h, never), self._tried.get(h, never))

        result = ScrubResult()
        for h in sorted(refs, key=lambda h: (last(h), h)):
            if result.bytes >= budget_bytes:
                break
            ref = refs[h]
            self._tried[h] = time.monotonic()
            if self.partial and live.before_read(ref) is None:
                continue  # not held here (another node's chunk): nothing read
            result.checked += 1
            result.bytes += ref.stored_size if ref.stored_size > 0 else ref.size
            damage = self._check(ref)
            if damage is None:
                self._reported.discard(h)
            elif h not in self._reported:
                self._reported.add(h)
                result.damaged.append(damage)
        return result

    def _check(self, ref: ChunkRef) -> ScrubDamage | None:
        store = self.store
        steps = store.liveness.steps_naming(ref.hash)
        step = steps[0] if steps else None  # named in the error
        try:
            if ref.codec == "raw" and maps_chunks(store):
                mapped = store.map_chunk(ref, step=step)  # the memory tier: hashed in place
                if isinstance(mapped, mmap.mmap):
                    mapped.close()
            else:
                store.read_chunk(ref, step=step)
            return None
        except StorageError as exc:  # an I/O error is not known damage: tried again next pass
            log.warning("scrub of %s could not read chunk %s: %s", store.url, ref.hash, exc)
            return None
        except CorruptCheckpointError as exc:
            error = str(exc)
        live = store.liveness
        try:
            live.sync()  # retention may have deleted every step naming it meanwhile
            if ref.hash not in live.referenced():
                return None
        except FlashCkptError as exc:
            log.warning("scrub of %s: cannot re-read the manifests: %s", store.url, exc)
        return ScrubDamage(
            chunk=ref.hash,
            steps=tuple(live.steps_naming(ref.hash)),
            error=error,
            quarantined=ref.hash in live.quarantined,
        )
