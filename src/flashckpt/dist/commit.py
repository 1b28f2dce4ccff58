"""The distributed commit: every rank writes its part, rank 0 publishes one manifest.

Numbered script of one distributed save (phases of :mod:`flashckpt.dist.attempt`):

1. ``plan`` (in ``save()``, before anything is written): rank 0 picks the tier for all ranks;
   a failure on any rank so far (capture, placement validation, a pending error) is the same
   :class:`DistributedError` on every rank, raised from ``save()``.
2. Stage and persist this rank's chunks in that tier (the ordinary :class:`SaveJob` pipeline),
   write this rank's part ``steps/<step>.rank-<r>.json`` (its shards, its per-rank tree).
3. Barrier ``save``: every rank posts ok or its error. Any failure -> every rank raises the same
   :class:`DistributedError` naming phase ``save`` and the failing ranks; nothing is published.
4. Rank 0 reads all parts, merges and validates them (:func:`merge_parts`), writes
   ``steps/<step>.json`` (the checkpoint now exists) and deletes the parts.
5. Barrier ``publish``: every rank learns the outcome. If the others gave up on rank 0 before it
   arrived (timeout), rank 0 deletes the manifest it wrote, so no rank believes in a checkpoint
   the others call failed.
6. Rank 0 applies retention and garbage collection -- only now, so a failed save never deletes
   an older checkpoint -- and barrier ``retain`` lets the others go on (gc never races their next
   save's chunks).

After a failure the parts are deleted from every tier and rank 0 collects the chunks nothing
references while the others wait (barrier ``cleanup``). If a rank is missing (timeout) each rank
deletes only its own part and the chunks are left to the next garbage collection.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from flashckpt.dist.attempt import SaveAttempt, describe
from flashckpt.dist.merge import merge_parts
from flashckpt.engine.save import SaveJob
from flashckpt.errors import DistributedError, FlashCkptError
from flashckpt.store.manifest import Manifest
from flashckpt.store.store import CheckpointStore, part_name

log = logging.getLogger(__name__)


class DistSaveJob(SaveJob):
    """A :class:`SaveJob` whose commit is the distributed protocol in the module docstring."""

    def __init__(
        self,
        *,
        attempt: SaveAttempt,
        per_rank: list[str],
        retain: Callable[[], None] | None,
        **kwargs: Any,
    ) -> None:
        super().__init__(committer=self._commit, **kwargs)
        self.attempt = attempt
        self.dist = attempt.dist
        self.per_rank = per_rank
        self.retain = retain

    def build_manifest(self) -> Manifest:
        m = super().build_manifest()
        m.rank_trees = {str(self.dist.rank): {n: m.tree[n] for n in self.per_rank}}
        return m

    def _commit(self, manifest: Manifest, chunk_dirs: list[str]) -> None:
        step, rank, store = manifest.step, self.dist.rank, self.ctx.store
        error = None
        try:
            store.commit(manifest, chunk_dirs=chunk_dirs, name=part_name(step, rank))
            self.release_pins()  # the part names our chunks: rank 0 may now collect garbage
        except Exception as exc:
            error = describe("writing its part", exc)
        self.attempt.agree("save", error)
        published = False
        if rank == 0:
            try:
                publish(store, step, self.dist.world_size)
                published = True
            except Exception as exc:
                error = describe("publishing the manifest", exc)
        try:
            self.attempt.agree("publish", error)
        except DistributedError:
            if published:  # the others gave up on rank 0: unpublish, as they all report
                store.delete_step(step)
            raise
        self._retain()

    def _retain(self) -> None:
        error = None
        if self.dist.rank == 0 and self.retain is not None:
            try:
                self.retain()
            except FlashCkptError as exc:
                log.warning("retention after step %d failed: %s", self.handle.step, exc)
            except Exception as exc:
                error = describe("retention", exc)
        try:
            self.attempt.agree("retain", error)
        except DistributedError as exc:  # the checkpoint exists; only the wait went wrong
            log.warning("step %d is committed; after retention: %s", self.handle.step, exc)
        self.dist.finished(self.attempt.barrier)

    def agree_failure(self, exc: BaseException) -> BaseException:
        return self.attempt.fail(exc, "staging/persisting")

    def cleanup_after_failure(self) -> None:
        self.release_pins(failed=True)  # before rank 0 collects what this save wrote
        self.attempt.cleanup()


def publish(store: CheckpointStore, step: int, world_size: int) -> None:
    """Rank 0: merge the parts into ``steps/<step>.json``, then drop the parts."""
    parts = [store.load_manifest(step, name=part_name(step, r)) for r in range(world_size)]
    store.commit(merge_parts(parts, step=step), chunk_dirs=[])
    for r in range(world_size):
        try:
            store.backend.delete(part_name(step, r))
        except OSError as exc:
            log.warning("could not delete part %s: %s", part_name(step, r), exc)
