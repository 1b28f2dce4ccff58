"""Load one committed step from one tier into the live state (the restore path).

From the caller's view a restore is all or nothing: :class:`Attempt` records when bytes of a
checkpoint first reached the live state; if no checkpoint then loads completely, the restore
raises a :class:`CorruptCheckpointError` saying the state was partly overwritten, instead of
returning None (``start = ckpt.restore(state) or 0`` would train on half-loaded weights).
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from flashckpt.engine.restore.lineage import Branch, judged_holders
from flashckpt.engine.restore.reader import read_plan
from flashckpt.errors import CorruptCheckpointError, NoCheckpointError, StorageError
from flashckpt.journal import Journal
from flashckpt.state.restore import RestorePlan, plan_restore
from flashckpt.store.files.oserrors import is_failure
from flashckpt.store.format.manifest import Manifest
from flashckpt.store.store import CheckpointStore, chunk_path

if TYPE_CHECKING:
    from flashckpt.engine.tiers.build import Tier
    from flashckpt.engine.tiers.tierset import TierSet

T = TypeVar("T")


class DistRestore(Protocol):
    """What a distributed restore offers this module (``distributed/runtime.py`` implements
    it): every rank loads the same step, rank 0's list of ``steps`` decides. Passed in by the
    Checkpointer, so the restore stage never imports the distributed package above it."""

    def restore(
        self,
        store: CheckpointStore,
        journal: Journal,
        state: Mapping[str, Any],
        *,
        step: int | None,
        steps: list[int],
        load: Callable[[int], Any],
        load_tier: Callable[[int, Any], object] | None = None,
        damaged: set[int] | None = None,
    ) -> int | None: ...


@dataclass(kw_only=True)
class Attempt:
    """One ``restore()`` call: which step first wrote into the live state (None: none did)."""

    touched: int | None = None
    damaged: set[int] = field(default_factory=set)  # steps whose every copy failed to verify

    def fail(self, exc: BaseException | None = None) -> CorruptCheckpointError:
        """The error of a restore that loaded nothing after touching the live state."""
        why = f" ({exc})" if exc is not None else ""
        return CorruptCheckpointError(
            f"no valid checkpoint could be loaded{why}, and loading step {self.touched} had "
            "already written into the live state: it is partly overwritten. Do not train on "
            "it: re-create the model and optimizer (fresh start) or restore an older step "
            "with restore(state, step=N)",
            step=getattr(exc, "step", None) or self.touched,
            key=getattr(exc, "key", None),
            chunk=getattr(exc, "chunk", None),
        )


def load_step(
    state: Mapping[str, Any],
    step: int,
    store: CheckpointStore,
    *,
    tier_name: str,
    strict: bool,
    rank: int,
    readers: int,
    journal: Journal | None,
    attempt: Attempt,
    backed: bool = False,
) -> Manifest:
    """Validate the manifest, match it to ``state`` (mismatches raise before any byte is read),
    read and verify the chunks in parallel straight into the targets, hand them over. The
    attempt records the step as having touched the live state only when the reader is about to
    write the first byte. ``backed``: a slower tier holds this step too, so a memory tier is
    read in one pass (copy and verify together, engine/restore/reader.py) and damage found
    there falls back to that copy; without one, every chunk is verified before the first write.
    Returns the manifest loaded (the caller queues its promotion without parsing it again: a
    manifest of 50,000 tensors takes 0.5 s to parse)."""
    t0 = time.perf_counter()
    manifest = store.load_manifest(step)
    plan = plan_restore(state, manifest, strict=strict, rank=rank)
    check_chunks_present(store, manifest, plan)

    def first_write() -> None:  # from here on, bytes land in the live tensors
        if attempt.touched is None:
            attempt.touched = step

    with ThreadPoolExecutor(readers, thread_name_prefix="flashckpt-read") as ex:
        loaded = read_plan(store, manifest, plan, ex, before_write=first_write, backed=backed)
    plan.finish(loaded)
    if journal is not None:
        journal.append(
            "restore",
            step=step,
            tier=tier_name,
            seconds=time.perf_counter() - t0,
            bytes=plan.nbytes,
        )
    return manifest


def backed(copies: list[Any], copy: object) -> bool:
    """Whether a slower copy of the same step follows ``copy`` in ``copies`` (fastest first):
    damage found by a one-pass read of ``copy`` is then made whole by loading that copy."""
    return any(c is copy for c in copies[:-1])


def check_chunks_present(store: CheckpointStore, manifest: Manifest, plan: RestorePlan) -> None:
    """Before any byte lands in the live state: every chunk the plan needs exists with the size
    the manifest records. A missing or truncated chunk is then found without touching the state
    (a flipped byte can only be found by reading, which may have loaded other tensors already;
    ``restore()`` then falls back to an older checkpoint that overwrites them all)."""
    needed: dict[int, str] = {}
    for key, target in plan.targets.items():
        for shard in target.entry.shards:
            for ext in shard.extents:
                needed.setdefault(ext.chunk, key)
    for index, key in needed.items():
        ref = manifest.chunks[index]
        path = chunk_path(ref.hash, ref.codec)
        what = ""
        try:
            size = store.backend.size(path)
        except FileNotFoundError:
            size, what = -1, "missing"
        except OSError as exc:  # a symlink, FIFO or directory there (never followed), or EIO
            if is_failure(exc):  # the device failed: says nothing about the bytes (not damage)
                raise StorageError(
                    f"could not check chunk {ref.hash} of tensor {key!r} in step "
                    f"{manifest.step}: {exc}"
                ) from exc
            size, what = -1, f"unreadable ({exc})"
        expected = ref.size if ref.codec == "raw" else ref.stored_size
        if size < 0 or (expected > 0 and size != expected):
            what = what or f"{size} bytes, expected {expected}"
            raise CorruptCheckpointError(
                f"chunk {ref.hash} of tensor {key!r} in step {manifest.step} is {what}",
                step=manifest.step,
                key=key,
                chunk=ref.hash,
            )


def restore_newest(
    holders: Mapping[int, list[T]],
    step: int | None,
    load: Callable[[int, T], object],
    across_tiers: Callable[[int, list[T], Callable[[T], Any]], object],
    attempt: Attempt,
) -> int | None:
    """Load ``step`` (errors propagate), or the newest step whose copies load (damaged ones are
    skipped with a warning); ``across_tiers`` tries a step's copies fastest tier first. None
    only when nothing was loaded and the live state is untouched (see :class:`Attempt`)."""
    if step is not None:
        try:
            across_tiers(step, list(holders.get(step, [])), partial(load, step))
        except (CorruptCheckpointError, StorageError) as exc:
            if attempt.touched is None:
                raise
            raise attempt.fail(exc) from exc
        return step
    last: BaseException | None = None
    for candidate in sorted(holders, reverse=True):
        try:
            across_tiers(candidate, list(holders[candidate]), partial(load, candidate))
            return candidate
        except NoCheckpointError as exc:  # retention deleted it while it was read: not damage
            last = exc
        except (CorruptCheckpointError, StorageError) as exc:
            last = exc
            if isinstance(exc, CorruptCheckpointError):
                attempt.damaged.add(candidate)
            warnings.warn(f"skipping damaged checkpoint step {candidate}: {exc}", stacklevel=3)
    if attempt.touched is not None:
        raise attempt.fail(last) from last
    return None


def restore_from_tiers(
    state: Mapping[str, Any],
    step: int | None,
    *,
    tiers: TierSet,
    store: CheckpointStore,
    dist: DistRestore | None,
    journal: Journal,
    strict: bool,
    rank: int,
    readers: int,
    attempt: Attempt,
    branch: Branch | None = None,
    owned: Tier | None = None,
) -> int | None:
    """The Checkpointer's restore: the newest valid step (or ``step``) of any tier, each step's
    copies chosen by lineage (engine/restore/lineage.py: a copy on an abandoned branch is
    skipped, journaled and removed from ``owned``, the memory tier this writer owns), then
    tried fastest tier first; under torch.distributed every rank loads the same step
    (``store``: the root's own store, where the ranks agree). ``branch`` learns the step
    restored (or that none was): this writer's branch point."""
    holders, verdict = judged_holders(tiers, journal, owned=owned)

    def load(s: int, t: Tier) -> Manifest:
        copies = holders.get(s, [])
        return load_step(
            state,
            s,
            t.store,
            tier_name=t.name,
            strict=strict,
            rank=rank,
            readers=readers,
            journal=journal,
            attempt=attempt,
            backed=backed(copies, t),
        )

    if dist is None:
        got = restore_newest(holders, step, load, tiers.restore, attempt)
    else:
        got = dist.restore(  # every rank loads the same step (distributed/restore.py)
            store,
            journal,
            state,
            step=step,
            steps=sorted(holders),
            load=lambda s: tiers.restore(s, holders.get(s, []), partial(load, s)),
            load_tier=load,
            damaged=attempt.damaged,  # steps no rank could load: a later save replaces them
        )
        if got is None and attempt.touched is not None:
            raise attempt.fail()
    if branch is not None:
        branch.restored(got, None if got is None else verdict.generation(got))
    return got
