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
from flashckpt.state.restore import plan_restore


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
    with ThreadPoolExecutor(readers, thread_name_prefix="flashckpt-read") as ex:
        loaded = read_plan(tier.store, manifest, plan, ex)
    plan.finish(loaded)
    journal.append(
        "restore", step=step, tier=tier.name, seconds=time.perf_counter() - t0, bytes=plan.nbytes
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
