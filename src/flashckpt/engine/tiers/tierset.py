"""Tiers: memory (/dev/shm) -> local disk -> remote object store, fastest first.

Each save commits to the fastest usable tier; the :class:`~flashckpt.engine.tiers.promote.Promoter`
then copies it to the slower tiers whose retention policy wants it. Restore takes the newest
step held by any tier, reading the fastest copy and falling back to the next tier's copy when one
is damaged or unreachable.

The tier configuration (names and paths/URLs, never credentials) is recorded in
``<tier root>/tiers.json`` of every local tier: ``flashckpt ls`` reads it, and its disappearance
tells a running job that a tier directory was deleted under it.
"""

from __future__ import annotations

import json
import logging
import shutil
import threading
import time
import warnings
from collections.abc import Callable
from typing import Any

from flashckpt.engine.tiers import identity as tierid
from flashckpt.engine.tiers.build import Tier, release_locks
from flashckpt.engine.tiers.config import CONFIG_NAME, public_url
from flashckpt.engine.tiers.promote import Promoter, PromoteTask, Promotion
from flashckpt.engine.tiers.tiercopy import Fresh
from flashckpt.errors import (
    CorruptCheckpointError,
    FlashCkptError,
    NoCheckpointError,
    StorageError,
)
from flashckpt.journal import Journal
from flashckpt.store.files import safeopen
from flashckpt.store.format.manifest import Manifest
from flashckpt.store.gc import GcResult, apply_retention, collect_garbage

log = logging.getLogger(__name__)

SPACE_MARGIN_BYTES = 64 << 20


def _config_entry(tier: Tier) -> dict[str, Any]:
    entry: dict[str, Any] = {"name": tier.name, "url": public_url(tier.url)}
    if tier.node_local:  # holds its node's chunks (and replicas) only: verify/ls must know
        entry["node_local"] = True
    return entry


class TierSet:
    """The tiers of one Checkpointer, their pins, and the promoter."""

    def __init__(
        self,
        tiers: list[Tier],
        *,
        journal: Journal,
        promotion: Promotion,
        extra_pins: Callable[[], set[str]],
    ) -> None:
        self.tiers = tiers
        self.journal = journal
        self.pinned = extra_pins  # chunks of the save in flight, for a collection outside retain
        self._extra_pins = extra_pins
        self._gc_lock = threading.Lock()
        self.promote_every = promotion.every
        self._cadence_lock = threading.Lock()
        self._counted = 0  # steps committed in the fastest tier by this process
        self.deferred: int | None = None  # the newest of them not queued for promotion
        self.promoter = Promoter(
            options=promotion,
            journal=journal,
            wants=self.wants,
            after=self.retain,
            release=self.release,
        )
        self.write_config()

    @property
    def fastest(self) -> Tier:
        return self.tiers[0]

    def by_name(self, name: str) -> Tier | None:
        return next((t for t in self.tiers if t.name == name), None)

    def write_config(self) -> None:
        """Record the tiers and the root id in every local tier (no link is followed)."""
        local = self.by_name("local")
        rid = tierid.ensure_root_id(local.path) if local and local.path else None
        doc = {
            "version": 1,
            "root_id": rid,
            "tiers": [_config_entry(t) for t in self.tiers],
        }
        data = json.dumps(doc, indent=1).encode()
        for t in self.tiers:
            if t.path is not None:
                safeopen.write_file_atomic(t.path, CONFIG_NAME, data, fsync=False)

    # -- saving -----------------------------------------------------------------------------
    def check_present(self) -> None:
        """Raise StorageError when a local tier's directory was deleted under the running job."""
        for t in self.tiers:
            if t.path is not None and not (t.path / CONFIG_NAME).exists():
                others = ", ".join(f"{o.name} {o.url}" for o in self.tiers if o is not t)
                raise StorageError(
                    f"the {t.name} tier {t.path} was deleted while this job was running "
                    f"({CONFIG_NAME} is gone), so its checkpoints are lost; checkpoints in the "
                    f"other tiers are intact ({others or 'none configured'}). Create a new "
                    "Checkpointer (it re-creates the directory) and restore() from them"
                )

    def target(self, *, step: int, nbytes: int) -> Tier:
        """The tier this save commits to: the fastest, unless the memory tier lacks space."""
        self.check_present()
        first = self.fastest
        if first.name != "memory" or first.path is None:
            return first
        if first.suspended is not None and len(self.tiers) > 1:
            return self.tiers[1]  # a node-local tier nobody replicates any more: disk instead
        free = shutil.disk_usage(first.path).free
        needed = nbytes + max(SPACE_MARGIN_BYTES, nbytes // 20)
        if free >= needed:
            return first
        nxt = self.tiers[1]
        msg = (
            f"memory tier {first.path} has {free} bytes free but step {step} needs about "
            f"{needed}; saving to the {nxt.name} tier {nxt.url} instead (enlarge /dev/shm or "
            "lower keep_memory)"
        )
        warnings.warn(msg, RuntimeWarning, stacklevel=4)
        log.warning(msg)
        self.journal.append(
            "tier_fallback",
            step=step,
            tier=first.name,
            to=nxt.name,
            needed_bytes=needed,
            free_bytes=free,
        )
        return nxt

    def committed(
        self,
        step: int,
        tier: Tier,
        manifest: Manifest | None = None,
        *,
        force: bool = False,
        fresh: Fresh | None = None,
    ) -> PromoteTask | None:
        """A step is durable in ``tier``: queue its promotion to the slower tiers (from the
        fastest tier, only every ``Promotion.every``-th step unless ``force``); returns the
        task queued (its ``done`` is set when it ended), None when nothing was. The task takes
        ``fresh`` (the pages the save kept mapped) and closes it when it ends; when no task is
        queued, the caller still holds it."""
        slower = self.tiers[self.tiers.index(tier) + 1 :]
        if not slower or tier.node_local:
            return None
        if tier is self.fastest and not self._due(step, force):
            return None
        m = manifest if manifest is not None else tier.store.load_manifest(step)
        pin = tier.store.liveness.pin(m.chunk_hashes(), kind="promote", step=step)
        task = PromoteTask(
            step=step, src=tier, manifest=m, dsts=slower, queued_t=time.time(), pin=pin, fresh=fresh
        )
        self.promoter.submit(task)
        return task

    def _due(self, step: int, force: bool) -> bool:
        with self._cadence_lock:
            due = force or self._counted % self.promote_every == 0
            self._counted += 1
            if due:
                if self.deferred is not None and self.deferred <= step:
                    self.deferred = None
            elif self.deferred is None or step > self.deferred:
                self.deferred = step
            return due

    def promote_deferred(self) -> None:
        """Queue the newest step the cadence left in the fastest tier (``close()``: the last
        checkpoint of a run always reaches the slower tiers)."""
        with self._cadence_lock:
            step, self.deferred = self.deferred, None
        if step is None:
            return
        try:
            if step in self.fastest.store.steps():
                self.committed(step, self.fastest, force=True)
        except FlashCkptError as exc:
            log.warning("cannot queue the promotion of step %d at close: %s", step, exc)

    def wants(self, dst: Tier, step: int) -> bool:
        """True when ``dst`` lacks ``step`` and its retention policy would keep it."""
        steps = dst.store.steps()
        if step in steps:
            return False
        return step in dst.keep.keep(sorted({*steps, step}))

    # -- retention ----------------------------------------------------------------------------
    def release(self, task: PromoteTask) -> None:
        """A promotion is done (or dropped): its source chunks are no longer pinned, so what
        the source tier's retention already dropped is collected now."""
        task.pin.release()
        if not task.src.store.liveness.has_garbage():
            return
        try:
            with self._gc_lock:
                res = collect_garbage(task.src.store, pinned=self._extra_pins())
        except FlashCkptError as exc:
            log.warning("gc of tier %s after promoting step %d: %s", task.src.name, task.step, exc)
            return
        self._journal_gc(task.src, (), res)

    def retain(self, tier: Tier) -> None:
        """Apply ``tier``'s retention and collect its garbage (the liveness module spares every
        pinned or referenced chunk; gc is skipped, and says so, while another process writes)."""
        self._delete_and_collect(tier, lambda: apply_retention(tier.store, tier.keep))

    def drop(self, tier: Tier, steps: list[int]) -> None:
        """Delete ``steps`` from ``tier`` (copies lineage abandoned: engine/restore/lineage.py)
        through the store, then collect what only they referenced (liveness decides)."""

        def delete() -> tuple[int, ...]:
            deleted = []
            for step in steps:
                try:
                    tier.store.delete_step(step)
                except FileNotFoundError:
                    continue
                deleted.append(step)
            return tuple(deleted)

        self._delete_and_collect(tier, delete)

    def _delete_and_collect(self, tier: Tier, delete: Callable[[], tuple[int, ...]]) -> None:
        """``delete()`` steps of ``tier`` and collect its garbage, under the gc lock."""
        with self._gc_lock:
            deleted = delete()
            if not tier.store.liveness.has_garbage():
                return
            res = collect_garbage(tier.store, pinned=self._extra_pins())
        self._journal_gc(tier, deleted, res)

    def _journal_gc(self, tier: Tier, deleted: tuple[int, ...], res: GcResult) -> None:
        if res.skipped is not None:
            self.journal.append(
                "gc_skipped", tier=tier.name, steps_deleted=list(deleted), reason=res.skipped
            )
        elif deleted or res.chunks_deleted or res.temp_deleted:
            self.journal.append(
                "gc",
                tier=tier.name,
                steps_deleted=list(deleted),
                chunks_deleted=res.chunks_deleted,
                bytes_deleted=res.bytes_deleted,
                temp_deleted=res.temp_deleted,
                full=res.full,
            )

    # -- restoring ----------------------------------------------------------------------------
    def holders(self) -> dict[int, list[Tier]]:
        """``{step: tiers holding it, fastest first}``; an unreachable tier is skipped."""
        out: dict[int, list[Tier]] = {}
        for t in self.tiers:
            try:
                steps = t.store.steps()
            except FlashCkptError as exc:
                msg = f"tier {t.name} ({t.url}) is unavailable, skipping it: {exc}"
                warnings.warn(msg, RuntimeWarning, stacklevel=3)
                self.journal.append("tier_unavailable", tier=t.name, error=str(exc))
                continue
            for s in steps:
                out.setdefault(s, []).append(t)
        return out

    def steps(self) -> list[int]:
        return sorted(self.holders())

    # -- shutdown -----------------------------------------------------------------------------
    def close(self, timeout_s: float | None) -> bool:
        """Wait for promotions (up to ``timeout_s``), stop the promoter, trim the fastest tier
        to its retention, then release the tier locks: never while the promoter may still
        write (a promoter stuck in a copy keeps them until the process exits)."""
        ok = True
        try:
            ok = self.promoter.drain(timeout_s)
            if not ok:
                log.warning(
                    "promotions still pending after %.1fs: %s", timeout_s, self.promoter.pending()
                )
        finally:
            stopped = self.promoter.stop()
            if stopped:
                self._trim(self.fastest)
                for tier in self.tiers:
                    _drain_recycled(tier)
                release_locks(self.tiers)
            else:
                self.journal.append("promote_stuck", reason="promoter did not stop at close")
                log.error(
                    "the promotion thread did not stop at close(); the tier locks stay held "
                    "until this process exits"
                )
        return ok

    def _trim(self, tier: Tier) -> None:
        if len(self.tiers) < 2:
            return
        try:
            self.retain(tier)
        except FlashCkptError as exc:
            log.warning("retention of tier %s at close failed: %s", tier.name, exc)

    def restore(self, step: int, tiers: list[Tier], load: Callable[[Tier], object]) -> Tier:
        """Run ``load(tier)`` on the fastest copy of ``step`` that is valid; a damaged or
        unreachable copy is journaled and the next tier's copy is tried. Then queue promotion
        of ``step`` to the slower tiers that lack it (a memory-only checkpoint after a crash;
        ``tiers``, the copies, says which hold it): from the manifest ``load`` returned, when it
        returned one, so a restore parses it once. Raises the last tier's error when no copy
        loads."""
        if not tiers:
            raise NoCheckpointError(f"no checkpoint for step {step} in any tier")
        for i, tier in enumerate(tiers):
            try:
                loaded = load(tier)
            except (CorruptCheckpointError, StorageError) as exc:
                # a lock-free reader racing retention finds chunks missing: not damage
                vanished = isinstance(exc, CorruptCheckpointError) and not tier.store.has_step(step)
                event = "corrupt" if isinstance(exc, CorruptCheckpointError) else "tier_unavailable"
                event = "vanished" if vanished else event
                self.journal.append(event, step=step, tier=tier.name, error=str(exc))
                if i + 1 == len(tiers) and vanished:
                    raise NoCheckpointError(
                        f"step {step} was deleted from the {tier.name} tier by retention while "
                        "it was being read (not damage); restore a newer step"
                    ) from exc
                if i + 1 == len(tiers):
                    raise
                nxt = tiers[i + 1].name
                msg = f"step {step}: the {tier.name} copy failed ({exc}); trying the {nxt} copy"
                warnings.warn(msg, RuntimeWarning, stacklevel=4)
                log.warning(msg)
                continue
            slower = self.tiers[self.tiers.index(tier) + 1 :] if tier in self.tiers else []
            if any(t not in tiers for t in slower):
                manifest = loaded if isinstance(loaded, Manifest) else None
                try:
                    self.committed(step, tier, manifest)
                except FlashCkptError as exc:
                    log.warning("cannot queue promotion of restored step %d: %s", step, exc)
            return tier
        raise NoCheckpointError(f"no checkpoint for step {step} in any tier")  # pragma: no cover


def _drain_recycled(tier: Tier) -> None:
    """A tier's recycled chunk files (store/files/staged.py FreePool) are no checkpoint: a
    clean close deletes them."""
    drain = getattr(tier.store.backend, "drain_free", None)
    if drain is None:
        return
    try:
        drain()
    except (OSError, FlashCkptError) as exc:
        log.warning("could not delete the recycled files of %s: %s", tier.url, exc)
