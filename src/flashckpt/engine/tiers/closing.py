"""What a clean ``close()`` gives back: the RAM of the memory tier.

A memory tier (``/dev/shm``) holds its checkpoints in RAM for as long as they exist, also after
the process ends. Once a run closes cleanly and every step in the memory tier is also committed
in a slower tier, those steps are only faster copies: :func:`empty_memory_tier` deletes them
and collects their chunks (through the store's liveness owner, like any retention). It keeps
the memory tier as it is, and journals ``memory_kept`` with the reason, when

* promotions to the slower tiers did not finish within the close timeout;
* any memory-tier step has no committed copy in a slower tier (a promotion that failed, or a
  slower tier whose retention does not keep that step), except the steps that
  ``Promotion(every=)`` kept in memory on purpose, older than a step a slower tier holds. A
  step whose promotion was dropped (``on_full="skip"``) and that a slower tier's retention
  still wants is promoted first (:func:`promote_dropped`, within the close timeout), so a
  slow disk during the run does not leave the memory tier full after a clean close;
* a slower tier cannot be listed (unreachable remote).

The Checkpointer calls it only for a single process (no torch.distributed: each node's memory
tier is its own and the ranks would have to agree) and never after SIGTERM (``handle_sigterm``):
a preempted close keeps everything. ``keep_memory_after_close=True`` turns it off.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from flashckpt.errors import FlashCkptError
from flashckpt.store.gc import collect_garbage

if TYPE_CHECKING:
    from flashckpt.engine.tiers.tierset import TierSet
    from flashckpt.journal import Journal

log = logging.getLogger(__name__)


class DistClosing(Protocol):
    """What closing needs of the distributed runtime (distributed/runtime.py)."""

    def stop(self) -> None: ...

    def close_tiers(
        self, tiers: TierSet, journal: Journal, *, empty: bool, timeout_s: float | None
    ) -> float | None: ...


def close_tiers(
    tiers: TierSet,
    journal: Journal,
    *,
    dist: DistClosing | None,
    empty: bool,
    timeout_s: float | None,
    preempted_left_s: Callable[[], float] | None = None,
) -> None:
    """The tiers' part of ``Checkpointer.close()``, once the save threads stopped: queue the
    deferred promotions, stop the distributed side, empty the memory tier where the run may
    (``empty``; never after SIGTERM: ``preempted_left_s`` gives the grace period left, which
    then bounds the rest instead of ``timeout_s``), and close the tiers within what is left."""
    tiers.promote_deferred()
    if dist is not None:
        dist.stop()
    left: float | None
    if preempted_left_s is not None:
        left = preempted_left_s()
    elif dist is None:
        left = empty_memory_tier(tiers, journal, timeout_s) if empty else timeout_s
    else:  # the owner of each tier empties it (distributed/closing.py)
        left = dist.close_tiers(tiers, journal, empty=empty, timeout_s=timeout_s)
    tiers.close(left)


def empty_memory_tier(tiers: TierSet, journal: Journal, timeout_s: float | None) -> float | None:
    """Wait up to ``timeout_s`` for promotions, then empty the memory tier when every step in
    it is committed in a slower tier. Returns what is left of ``timeout_s`` for the rest of
    ``close()`` (None: unbounded)."""
    mem = tiers.fastest
    if mem.name != "memory" or len(tiers.tiers) < 2:
        return timeout_s
    t0 = time.monotonic()

    def left_s() -> float | None:
        return None if timeout_s is None else max(0.0, timeout_s - (time.monotonic() - t0))

    drained = promote_dropped(tiers, left_s)
    left = left_s()
    if not drained:
        _kept(journal, "promotions to the slower tiers did not finish before close", [])
        return left
    try:
        steps = mem.store.steps()
        slower = [set(t.store.steps()) for t in tiers.tiers[1:]]
        only_here = [s for s in steps if not any(s in held for held in slower)]
        if tiers.promote_every > 1:  # older steps the cadence kept out of the slower tiers
            newest = max((max(held) for held in slower if held), default=None)
            only_here = [s for s in only_here if newest is None or s > newest]
        if only_here:
            _kept(journal, "steps not committed in a slower tier", only_here)
            return left
        for s in steps:
            mem.store.delete_step(s)
        res = collect_garbage(mem.store, pinned=tiers.pinned())
    except FlashCkptError as exc:
        _kept(journal, f"cannot check or empty it: {exc}", [])
        return left
    journal.append(
        "memory_emptied",
        tier=mem.name,
        steps_deleted=steps,
        bytes_deleted=res.bytes_deleted,
        skipped=res.skipped,
    )
    log.info("memory tier %s emptied at close: steps %s are in slower tiers", mem.url, steps)
    return left


def promote_dropped(tiers: TierSet, left_s: Callable[[], float | None]) -> bool:
    """Promote, one at a time, each memory-tier step that no slower tier holds and a slower
    tier's retention wants (its promotion was dropped while the queue was full); the steps the
    ``every=`` cadence kept in memory on purpose are left as they are. True when every
    promotion finished within ``left_s()``."""
    if not tiers.promoter.drain(left_s()):
        return False
    mem, slower = tiers.fastest, tiers.tiers[1:]
    try:
        held = [set(t.store.steps()) for t in slower]
        steps = mem.store.steps()
        newest = max((max(h) for h in held if h), default=None)
        for step in steps:
            if any(step in h for h in held):
                continue
            if tiers.promote_every > 1 and newest is not None and step < newest:
                continue  # the cadence's own choice (see empty_memory_tier)
            if not any(tiers.wants(t, step) for t in slower):
                continue
            tiers.committed(step, mem, force=True)
            if not tiers.promoter.drain(left_s()):
                return False
    except FlashCkptError as exc:  # the caller's listing says why it keeps the tier
        log.warning("cannot promote the dropped steps at close: %s", exc)
    return True


def _kept(journal: Journal, reason: str, steps: list[int]) -> None:
    journal.append("memory_kept", reason=reason, steps=steps)
    log.info("memory tier kept at close (%s%s)", reason, f": {steps}" if steps else "")
