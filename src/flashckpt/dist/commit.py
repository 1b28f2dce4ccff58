"""The distributed commit: every rank writes its part, rank 0 publishes one manifest.

Numbered script of one distributed save (every rank runs it on its save thread):

1. Stage and persist this rank's chunks (the ordinary :class:`SaveJob` pipeline).
2. Write this rank's part ``steps/<step>.rank-<r>.json`` (its shards, its per-rank tree).
3. Barrier ``save``: every rank posts ok or its error. Any failure -> every rank raises the same
   :class:`DistributedError` naming phase ``save`` and the failing ranks; nothing is published.
   A rank that fails before step 2 still posts its error here, so nobody waits for it.
4. Rank 0 reads all parts, merges them (:func:`merge_parts`), writes ``steps/<step>.json`` (the
   checkpoint now exists), deletes the parts, applies retention and garbage collection (the
   other ranks wait, so no chunk of theirs is in flight).
5. Barrier ``publish``: every rank learns the outcome; a failure on rank 0 raises the same
   error everywhere.

After a failure the parts are deleted and rank 0 collects the chunks nothing references while
the others wait (barrier ``cleanup``), so a rank's next save never reuses a chunk being
deleted. If a rank is missing (timeout) the cleanup is left to the next garbage collection.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from flashckpt.dist.context import DistContext
from flashckpt.dist.merge import merge_parts
from flashckpt.engine.save import SaveJob
from flashckpt.errors import DistributedError, FlashCkptError
from flashckpt.store.gc import collect_garbage
from flashckpt.store.manifest import Manifest
from flashckpt.store.store import CheckpointStore, part_name

log = logging.getLogger(__name__)
_HINT = "; nothing was published and older checkpoints are intact"


class DistSaveJob(SaveJob):
    """A :class:`SaveJob` whose commit is the distributed protocol in the module docstring."""

    def __init__(
        self,
        *,
        dist: DistContext,
        per_rank: list[str],
        retain: Callable[[], None] | None,
        **kwargs: Any,
    ) -> None:
        super().__init__(committer=self._commit, **kwargs)
        self.dist = dist
        self.per_rank = per_rank
        self.retain = retain
        self.barrier = dist.barrier(f"save-{self.handle.step}")
        self._posted = False  # this rank has posted its status to the "save" phase
        self._missing = False  # a rank never arrived: leave cleanup to the next gc

    def build_manifest(self) -> Manifest:
        m = super().build_manifest()
        m.rank_trees = {str(self.dist.rank): {n: m.tree[n] for n in self.per_rank}}
        return m

    def _commit(self, manifest: Manifest, chunk_dirs: list[str]) -> None:
        step, rank = manifest.step, self.dist.rank
        error = None
        try:
            self.ctx.store.commit(manifest, chunk_dirs=chunk_dirs, name=part_name(step, rank))
            self.release_pins()  # the part names our chunks: rank 0 may now collect garbage
        except Exception as exc:
            error = _describe("writing its part", exc)
        self._posted = True
        self._phase("save", error)
        if rank == 0:
            try:
                publish(self.ctx.store, step, self.dist.world_size, self.retain)
            except Exception as exc:
                error = _describe("publishing the manifest", exc)
        self._phase("publish", error)

    def _phase(self, phase: str, error: str | None) -> None:
        try:
            self.barrier.agree(phase, error, step=self.handle.step, hint=_HINT)
        except DistributedError:
            self._missing = self.barrier.timed_out
            raise

    def agree_failure(self, exc: BaseException) -> BaseException:
        if self._posted:  # failed in or after the "save" phase: the ranks already agreed
            return exc
        self._posted = True  # failed before its part: tell the others, agree on one error
        try:
            self._phase("save", _describe("staging/persisting", exc))
        except DistributedError as agreed:
            agreed.__cause__ = exc
            return agreed
        return exc

    def cleanup_after_failure(self) -> None:
        self.release_pins(failed=True)
        if self._missing:
            return
        store = self.ctx.store
        if self.dist.rank == 0:
            try:
                for r in range(self.dist.world_size):
                    store.backend.delete(part_name(self.handle.step, r))
                collect_garbage(store)
            except Exception as exc:
                log.warning("cleanup after failed step %d: %s", self.handle.step, exc)
        try:
            self.barrier.agree("cleanup", None, step=self.handle.step)
        except DistributedError as exc:
            log.warning("cleanup barrier after failed step %d: %s", self.handle.step, exc)


def publish(
    store: CheckpointStore, step: int, world_size: int, retain: Callable[[], None] | None
) -> None:
    """Rank 0: merge the parts into ``steps/<step>.json``, drop the parts, apply retention."""
    parts = [store.load_manifest(step, name=part_name(step, r)) for r in range(world_size)]
    store.commit(merge_parts(parts, step=step), chunk_dirs=[])
    for r in range(world_size):
        try:
            store.backend.delete(part_name(step, r))
        except OSError as exc:
            log.warning("could not delete part %s: %s", part_name(step, r), exc)
    if retain is not None:
        try:
            retain()
        except FlashCkptError as exc:
            log.warning("retention after step %d failed: %s", step, exc)


def _describe(doing: str, exc: BaseException) -> str:
    return f"{doing}: {type(exc).__name__}: {exc}"
