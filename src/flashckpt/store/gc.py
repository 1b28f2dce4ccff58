"""Retention and garbage collection, on the facts the liveness module owns.

A chunk is garbage when no committed manifest, no rank part, no pin (in this process or in
``pins/`` on disk) and no open writer window names it. Collection:

1. takes the root lock exclusively, without waiting: while any writer of any process holds it
   shared, nothing is collected and the result says so (``skipped``);
2. brings the manifest cache up to date and reads every pin file: ANY error reading a
   manifest, a part or a pin aborts the collection and deletes nothing (fail closed);
3. deletes the candidates: the chunks whose last reference or pin went away since the last
   collection (cost proportional to what changed, not to the history kept), the chunks
   recorded by failed saves and promotions of any process, and, on a full sweep, every
   unreferenced chunk file plus the temporary files of processes that are gone. A full sweep
   runs on the first collection of a process, after an expired pin (a process that died
   mid-save), and for ``flashckpt gc``.
"""

from __future__ import annotations

import logging
from collections.abc import Collection
from dataclasses import dataclass

from flashckpt.errors import CorruptCheckpointError, FlashCkptError
from flashckpt.policy.retention import RetentionPolicy
from flashckpt.store.format.names import SUFFIX, chunk_path, parse_chunk_name, temp_owner
from flashckpt.store.liveness import Liveness
from flashckpt.store.pins import PinRecord, pid_alive, read_pins
from flashckpt.store.store import STAGING_DIR, CheckpointStore

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class GcResult:
    steps_deleted: tuple[int, ...] = ()
    chunks_deleted: int = 0
    bytes_deleted: int = 0
    temp_deleted: int = 0
    full: bool = False
    skipped: str | None = None  # why nothing was collected (lock busy, unreadable manifest/pin)
    busy: bool = False  # skipped because a writer holds the root (try again later), not damage
    damaged: bool = False  # skipped because a manifest, part or pin is damaged (not an I/O error)


def apply_retention(store: CheckpointStore, policy: RetentionPolicy) -> tuple[int, ...]:
    """Delete manifests the policy does not keep; the newest step is always kept. Their
    chunks become candidates of the next :func:`collect_garbage`."""
    live = store.liveness
    with live.mutex:
        try:
            live.sync()  # know the chunks of what is deleted (manifests committed elsewhere)
        except FlashCkptError as exc:
            log.warning("retention on %s: %s; the next gc sweeps everything", store.url, exc)
            live.needs_full = True
        steps = store.steps()
        if not steps:
            return ()
        keep = set(policy.keep(steps)) | {steps[-1]}
        doomed = tuple(s for s in steps if s not in keep)
        for s in doomed:
            store.delete_step(s)
    return doomed


def referenced_chunks(store: CheckpointStore) -> set[str]:
    """Every chunk a committed manifest or part names; raises on any unreadable one."""
    store.liveness.sync()
    return store.liveness.referenced()


def collect_garbage(
    store: CheckpointStore, *, pinned: Collection[str] = (), full: bool = False
) -> GcResult:
    """Delete chunks nothing needs (module docstring); never one in ``pinned``."""
    live = store.liveness
    with live.exclusive() as got:
        if not got:
            why = "a save or promotion of another process is writing it"
            return _skipped(store, why, busy=True)
        try:
            live.sync()
            records = read_pins(store.backend) if live.pins_on_disk else []
        except FlashCkptError as exc:
            return _skipped(store, str(exc), damaged=isinstance(exc, CorruptCheckpointError))
        return _collect(store, live, records, set(pinned), full)


def _collect(
    store: CheckpointStore, live: Liveness, records: list[PinRecord], pinned: set[str], full: bool
) -> GcResult:
    expired = [r for r in records if r.owner_dead()]
    done = [r for r in records if r.state == "failed" or r in expired]
    keep = {h for r in records if r not in done for h in r.hashes}
    full = full or live.needs_full or bool(expired)
    failed = {h for r in done for h in r.hashes}  # another process's writes: any codec
    candidates = set(live.candidates) | failed
    files = _all_chunk_files(store) if full else None
    if files is not None:
        candidates |= set(files)
    alive = live.referenced() | live.pinned() | keep | pinned
    doomed = []
    for h in candidates - alive:
        if files is not None:
            doomed.append((h, files.get(h, [])))
        else:
            doomed.append((h, _paths(h) if h in failed else live.chunk_paths(h)))
    sizes = iter(_delete(store, [p for _, paths in doomed for p in paths]))
    deleted = freed = 0
    for h, paths in doomed:
        got = [next(sizes) for _ in paths]
        if any(n >= 0 for n in got):
            deleted += 1
            freed += sum(n for n in got if n > 0)
        live.forget(h)
    # still pinned (not referenced): look again once the pin goes
    live.candidates = (candidates & alive) - live.referenced()
    temps = _delete_stale_temps(store) if full else 0
    for r in done:
        store.backend.delete(r.path)
    if full:
        live.needs_full = False
    return GcResult(chunks_deleted=deleted, bytes_deleted=freed, temp_deleted=temps, full=full)


def _skipped(
    store: CheckpointStore, why: str, *, busy: bool = False, damaged: bool = False
) -> GcResult:
    msg = f"garbage collection of {store.url} skipped, nothing was deleted: {why}"
    log.warning(msg)
    return GcResult(skipped=msg, busy=busy, damaged=damaged)


def _paths(h: str) -> list[str]:
    return [chunk_path(h, codec) for codec in SUFFIX]


def _delete(store: CheckpointStore, paths: list[str]) -> list[int]:
    """Delete chunk files; the size of each (-1 when it was not there). A local backend does
    them in one pass (``LocalBackend.remove_files``: each directory opened once, and on a
    memory tier the files kept in its recycling pool instead of deleted)."""
    remove = getattr(store.backend, "remove_files", None)
    if remove is not None:
        return list(remove(paths))
    out = []
    for path in paths:
        try:
            size = store.backend.size(path)
        except OSError:
            out.append(-1)
            continue
        store.backend.delete(path)
        out.append(size)
    return out


def _all_chunk_files(store: CheckpointStore) -> dict[str, list[str]]:
    files: dict[str, list[str]] = {}
    for sub in store.backend.list("chunks"):
        for name in store.backend.list(f"chunks/{sub}"):
            parsed = parse_chunk_name(name)
            if parsed is not None:
                files.setdefault(parsed[0], []).append(f"chunks/{sub}/{name}")
    return files


def _delete_stale_temps(store: CheckpointStore) -> int:
    """Temporary files (``*.tmp-<pid>-<n>``) of processes that are gone."""
    list_temp = getattr(store.backend, "list_temp", None)
    if list_temp is None:
        return 0
    dirs = ["steps", "pins", STAGING_DIR]
    dirs += [f"chunks/{sub}" for sub in store.backend.list("chunks")]
    n = 0
    for d in dirs:
        for name in list_temp(d):
            pid = temp_owner(name)
            if pid is not None and not pid_alive(pid):
                store.backend.delete(f"{d}/{name}")
                n += 1
    return n
