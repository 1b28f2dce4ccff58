"""Retention and garbage collection.

A chunk is garbage when no manifest (committed step or a rank's part) references it and no save
in flight has pinned it. Only the process holding the writer lock collects garbage.
"""

from __future__ import annotations

import logging
from collections.abc import Collection
from dataclasses import dataclass

from flashckpt.errors import FlashCkptError
from flashckpt.policy.retention import RetentionPolicy
from flashckpt.store.manifest import HASH_RE
from flashckpt.store.store import CheckpointStore

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class GcResult:
    steps_deleted: tuple[int, ...] = ()
    chunks_deleted: int = 0
    bytes_deleted: int = 0


def apply_retention(store: CheckpointStore, policy: RetentionPolicy) -> tuple[int, ...]:
    """Delete manifests the policy does not keep; the newest step is always kept."""
    steps = store.steps()
    if not steps:
        return ()
    keep = set(policy.keep(steps)) | {steps[-1]}
    doomed = tuple(s for s in steps if s not in keep)
    for s in doomed:
        store.delete_step(s)
    return doomed


def referenced_chunks(store: CheckpointStore) -> set[str]:
    refs: set[str] = set()
    for step in store.steps():
        try:
            refs |= store.load_manifest(step).chunk_hashes()
        except FlashCkptError as exc:
            log.warning("gc: ignoring unreadable manifest for step %s: %s", step, exc)
    for name in store.part_names():
        try:
            refs |= store.load_manifest(-1, name=f"steps/{name}").chunk_hashes()
        except FlashCkptError as exc:
            log.warning("gc: ignoring unreadable part manifest %s: %s", name, exc)
    return refs


def collect_garbage(store: CheckpointStore, *, pinned: Collection[str] = ()) -> GcResult:
    """Delete chunks that nothing references; never one in ``pinned`` (in-flight saves)."""
    live = referenced_chunks(store) | set(pinned)
    backend = store.backend
    deleted = 0
    freed = 0
    for sub in backend.list("chunks"):
        for name in backend.list(f"chunks/{sub}"):
            h = name.partition(".")[0]
            if not HASH_RE.match(h) or h in live:
                continue
            path = f"chunks/{sub}/{name}"
            try:
                freed += backend.size(path)
            except OSError:
                pass
            backend.delete(path)
            store.forget_chunk(h)
            deleted += 1
    return GcResult(chunks_deleted=deleted, bytes_deleted=freed)
