"""A step is saved once: the rule, and the check every save makes before any work.

Saving a step that is already committed would rewrite only the tier the save lands in (the
promoter never overwrites a step a slower tier holds), so the tiers would disagree about what
that step is, and which copy a restore reads would depend on which tier answers first. So
``save(step)`` refuses a step any tier already holds, with a :class:`ConfigError` naming the
step and the tiers. The preemption path (engine/runtime/preempt.py) and the integrations skip a step
that is already committed instead of saving it again.

One exception: a step this Checkpointer's ``restore()`` skipped because every copy failed
verification (or, under peer replication, because no node can assemble it any more: published
in the node tiers, its node lost before it was replicated) is replaced: its manifests are
deleted from every tier first (journaled ``damaged_step_replaced``; gc collects its chunks), so
a run that fell back to an older step can save that step number again when it gets there.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from flashckpt.errors import ConfigError
from flashckpt.store.store import step_name

if TYPE_CHECKING:
    from flashckpt.engine.tiers.build import Tier
    from flashckpt.journal import Journal


def holding(tiers: Iterable[Tier], step: int) -> list[Tier]:
    """The tiers whose ``steps/`` hold ``step`` (one existence check per tier)."""
    return [t for t in tiers if t.store.backend.exists(step_name(step))]


def refuse_existing(
    tiers: Iterable[Tier], step: int, *, damaged: set[int], journal: Journal
) -> None:
    """Raise :class:`ConfigError` when ``step`` is already committed in one of ``tiers``,
    unless it is in ``damaged`` (then its manifests are deleted from every tier)."""
    found = holding(tiers, step)
    if found and step in damaged:
        for t in found:
            try:
                t.store.delete_step(step)
            except FileNotFoundError:  # another rank deleted it from a tier they share
                pass
        damaged.discard(step)
        journal.append("damaged_step_replaced", step=step, tiers=[t.name for t in found])
        return
    if found:
        where = ", ".join(f"the {t.name} tier ({t.url})" for t in found)
        raise ConfigError(
            f"step {step} is already committed in {where}; a step is saved once, so that "
            f"every tier holds the same checkpoint. After restore() returned {step}, the next "
            f"step to train and save is {step + 1}; to keep this state too, save it under a "
            "new step number"
        )
