"""Load one committed step from one tier into the live state (the restore path)."""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any

from flashckpt.engine.reader import read_plan
from flashckpt.engine.tiers import Tier
from flashckpt.errors import CorruptCheckpointError, StorageError
from flashckpt.journal import Journal
from flashckpt.state.restore import RestorePlan, plan_restore
from flashckpt.store.manifest import Manifest
from flashckpt.store.store import CheckpointStore, chunk_path


def load_step(
    state: Mapping[str, Any],
    step: int,
    tier: Tier,
    *,
    strict: bool,
    rank: int,
    readers: int,
    journal: Journal,
) -> None:
    """Validate the manifest, match it to ``state`` (mismatches raise before any byte is read),
    read and verify the chunks in parallel straight into the targets, hand them over."""
    t0 = time.perf_counter()
    manifest = tier.store.load_manifest(step)
    plan = plan_restore(state, manifest, strict=strict, rank=rank)
    check_chunks_present(tier.store, manifest, plan)
    with ThreadPoolExecutor(readers, thread_name_prefix="flashckpt-read") as ex:
        loaded = read_plan(tier.store, manifest, plan, ex)
    plan.finish(loaded)
    journal.append(
        "restore", step=step, tier=tier.name, seconds=time.perf_counter() - t0, bytes=plan.nbytes
    )


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
        try:
            size = store.backend.size(path)
        except (FileNotFoundError, OSError):
            size = -1
        expected = ref.size if ref.codec == "raw" else ref.stored_size
        if size < 0 or (expected > 0 and size != expected):
            what = "missing" if size < 0 else f"{size} bytes, expected {expected}"
            raise CorruptCheckpointError(
                f"chunk {ref.hash} of tensor {key!r} in step {manifest.step} is {what}",
                step=manifest.step,
                key=key,
                chunk=ref.hash,
            )


def restore_newest(
    holders: Mapping[int, list[Tier]],
    step: int | None,
    load: Callable[[int, Tier], None],
    across_tiers: Callable[[int, list[Tier], Callable[[Tier], None]], object],
) -> int | None:
    """Load ``step`` (errors propagate), or the newest step whose copies load (damaged ones are
    skipped with a warning); ``across_tiers`` tries a step's copies fastest tier first."""
    if step is not None:
        across_tiers(step, list(holders.get(step, [])), partial(load, step))
        return step
    for candidate in sorted(holders, reverse=True):
        try:
            across_tiers(candidate, list(holders[candidate]), partial(load, candidate))
            return candidate
        except (CorruptCheckpointError, StorageError) as exc:
            warnings.warn(f"skipping damaged checkpoint step {candidate}: {exc}", stacklevel=3)
    return None
