"""The distributed commit: every rank writes its part, rank 0 publishes one manifest.

Numbered script of one distributed save (phases of :mod:`flashckpt.distributed.attempt`):

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

**Node-local memory tier** (``replicas=1``: each node has its own memory tier, rank 0 cannot
read the other nodes' parts). Steps 3-6 become:

3'. Each rank writes its part in its node's tier (it keeps its chunks referenced there) and
    posts it in the Store (``<barrier>/part/<rank>``); barrier ``save`` as above.
4'. Rank 0 reads the parts from the Store, merges and validates them and posts the merged
    manifest (``<barrier>/merged``); barrier ``merge`` carries its error, if any.
5'. Every node's local leader writes the same ``steps/<step>.json`` into its node's tier (the
    chunks of other nodes' ranks are absent there: normal for a node-local tier, until peer
    replication brings those of its source ranks); barrier ``publish``. If any leader failed or
    a rank timed out, every leader that wrote the manifest deletes it again; each rank deletes
    its own part once the manifest is published.
6'. Every local leader applies its node tier's retention and gc; barrier ``retain``.

After a failure the parts are deleted from every tier and rank 0 collects the chunks nothing
references while the others wait (barrier ``cleanup``). If a rank is missing (timeout) each rank
deletes only its own part and the chunks are left to the next garbage collection.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from flashckpt.distributed.attempt import SaveAttempt, describe
from flashckpt.distributed.group.nodes import NodeMap
from flashckpt.distributed.merge import merge_parts
from flashckpt.engine.save.job import SaveJob
from flashckpt.errors import DistributedError, OutcomeUnknownError
from flashckpt.store.format.manifest import Manifest
from flashckpt.store.format.parse import parse_manifest
from flashckpt.store.store import CheckpointStore, part_name

log = logging.getLogger(__name__)


class DistSaveJob(SaveJob):
    """A :class:`SaveJob` whose commit is the distributed protocol in the module docstring."""

    def __init__(
        self,
        *,
        attempt: SaveAttempt,
        per_rank: list[str],
        retain: Callable[[], object] | None,
        nodes: NodeMap | None = None,
        published: Callable[[Manifest], None] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(committer=self._commit, **kwargs)
        self.attempt = attempt
        self.dist = attempt.dist
        self.per_rank = per_rank
        self.retain = retain
        # node-local memory tier (replicas=1): every node leader publishes into its own tier
        self.nodes = (
            nodes if nodes is not None and getattr(self.tier, "node_local", False) else None
        )
        self.published = published  # told of this rank's part once the step is published

    def build_manifest(self) -> Manifest:
        m = super().build_manifest()
        m.rank_trees = {str(self.dist.rank): {n: m.tree[n] for n in self.per_rank}}
        return m

    def _commit(self, manifest: Manifest, chunk_dirs: list[str]) -> None:
        if self.nodes is not None:
            self._commit_node_local(manifest, chunk_dirs, self.nodes)
            return
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
        except DistributedError as exc:
            if published:  # the others gave up on rank 0: unpublish, as they all report
                store.delete_step(step)
            raise _unknown_if_publisher_lost(exc, step, [0], self.attempt.barrier) from None
        self._retain()

    def _commit_node_local(self, manifest: Manifest, chunk_dirs: list[str], nodes: NodeMap) -> None:
        """Steps 3'-6' of the module docstring."""
        step, rank, store = manifest.step, self.dist.rank, self.ctx.store
        keys = _Keys(self.attempt.barrier.prefix, self.dist.world_size)
        error = None
        try:
            store.commit(manifest, chunk_dirs=chunk_dirs, name=part_name(step, rank))
            self.release_pins()  # the part names our chunks in this node's tier
            self.dist.store.set(keys.part(rank), manifest.to_json())
        except Exception as exc:
            error = describe("writing its part", exc)
        cleanup = self.attempt.barrier.cleanup if rank == 0 else []  # deleted by the leader
        try:  # once the next phase is full: parts after merge, the merged one after publish
            self.attempt.agree("save", error)
        finally:
            cleanup.extend(keys.parts())
        if rank == 0:
            error = _merge_in_store(self.dist.store, keys, step)
        try:
            self.attempt.agree("merge", error)
        finally:
            cleanup.append(keys.merged)
        published = False
        if nodes.is_leader(rank):
            try:
                merged = self.dist.store.get(keys.merged)
                _publish_merged(store, step, bytes(merged))
                published = True
            except Exception as exc:
                error = describe("publishing the manifest in its node's tier", exc)
        try:
            self.attempt.agree("publish", error)
        except DistributedError as exc:
            if published:  # another node failed or timed out: nobody believes in this step
                store.delete_step(step)
            publishers = nodes.leaders()
            raise _unknown_if_publisher_lost(exc, step, publishers, self.attempt.barrier) from None
        _delete_part(store, part_name(step, rank))
        if self.published is not None:
            self.published(manifest)
        self._retain(leader=nodes.is_leader(rank))

    def _retain(self, *, leader: bool | None = None) -> None:
        error = None
        leader = self.dist.rank == 0 if leader is None else leader
        if leader and self.retain is not None:
            try:
                self.retain()  # engine/tiers/aftersave.py: logs its own errors
            except Exception as exc:  # a bug there: every rank hears of it
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


def _unknown_if_publisher_lost(
    exc: DistributedError, step: int, publishers: list[int], barrier: Any
) -> DistributedError:
    """The error of a failed ``publish`` phase. When a rank that writes the manifest (rank 0,
    or a node leader) is among those that never answered, every part was durable and it may
    have published before it stopped: the outcome is unknown, and saying "nothing was
    published" would be false (a restart would restore the step). Deleting the manifest from
    here cannot make it false either: a publisher that is stalled, not dead, writes it after.
    So the error says what is known: :class:`OutcomeUnknownError`."""
    lost = sorted(set(barrier.missing) & set(publishers)) if barrier.timed_out else []
    if not lost:
        return exc
    err = OutcomeUnknownError(
        f"checkpoint step {step}: outcome unknown. Every rank's part was durable, then rank(s) "
        f"{lost}, which publish the manifest, stopped answering in phase 'publish' (timeout after "
        f"{barrier.timeout_s:g}s, or the Store they host is gone). "
        f"Step {step} may or may not be committed: restore() loads it if it is (it is then "
        "complete and verified) and an older step if not; older checkpoints are intact",
        phase="publish",
        ranks=lost,
    )
    err.__cause__ = exc
    return err


def publish(store: CheckpointStore, step: int, world_size: int) -> None:
    """Rank 0: merge the parts into ``steps/<step>.json``, then drop the parts."""
    parts = [store.load_manifest(step, name=part_name(step, r)) for r in range(world_size)]
    store.commit(merge_parts(parts, step=step), chunk_dirs=[])
    for r in range(world_size):
        try:
            store.backend.delete(part_name(step, r))
        except OSError as exc:
            log.warning("could not delete part %s: %s", part_name(step, r), exc)


class _Keys:
    """Store keys of a node-local commit, under the save attempt's barrier prefix."""

    def __init__(self, prefix: str, world_size: int) -> None:
        self.prefix = prefix
        self.world_size = world_size
        self.merged = f"{prefix}/merged"

    def part(self, rank: int) -> str:
        return f"{self.prefix}/part/{rank}"

    def parts(self) -> list[str]:
        return [self.part(r) for r in range(self.world_size)]


def _merge_in_store(kv: Any, keys: _Keys, step: int) -> str | None:
    """Rank 0: merge the parts posted in the Store and post the manifest; the error, if any."""
    try:
        raws = kv.multi_get(keys.parts())
        parts = [
            parse_manifest(bytes(raw), where=f"part of rank {r} (Store)", whole=False)
            for r, raw in enumerate(raws)
        ]
        kv.set(keys.merged, merge_parts(parts, step=step).to_json())
    except Exception as exc:
        return describe("merging the parts", exc)
    return None


def _publish_merged(store: CheckpointStore, step: int, raw: bytes) -> None:
    """A node leader: commit rank 0's merged manifest in this node's tier."""
    manifest = parse_manifest(raw, where=f"merged manifest of step {step} (Store)")
    if manifest.step != step:
        raise DistributedError(
            f"the merged manifest is for step {manifest.step}, expected {step}",
            phase="publish",
            ranks=[0],
        )
    store.commit(manifest, chunk_dirs=[])


def _delete_part(store: CheckpointStore, name: str) -> None:
    try:
        store.backend.delete(name)
    except FileNotFoundError:
        pass
    except OSError as exc:
        log.warning("could not delete part %s: %s", name, exc)
