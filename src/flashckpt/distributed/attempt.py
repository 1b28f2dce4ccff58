"""One attempt of a distributed save, from ``save()`` until every rank knows its outcome.

The attempt owns the barrier of the save (keyed by step and attempt,
:mod:`flashckpt.distributed.group.context`) and remembers which phase this rank posted last, so
that a failure anywhere -- before the save job exists (``state_dict()``, an out-of-memory copy, a
pending error) or inside it -- is posted once, at the phase the others are waiting in, and becomes
the same :class:`~flashckpt.errors.DistributedError` on every rank.

Phases, in order (every rank, every attempt):

``plan``     training thread, before anything is written: each rank posts ok (its byte
             count, and whether its memory tier is suspended: its replication stopped) or its
             error; a suspension posted by any rank suspends the tier on every rank, then
             rank 0 picks the tier for the whole save (``TierSet.target`` on the summed
             bytes) and every rank takes it by name.
``save``     after this rank's chunks and part are durable (or it failed).
``publish``  after rank 0 wrote ``steps/<step>.json`` (or failed to).
``retain``   after rank 0 applied retention and gc (the others wait so gc never races their next
             save's chunks); a timeout here is only a warning: the checkpoint exists.
``cleanup``  after a failure past ``plan``: rank 0 deleted every part of the step in every tier
             and collected the chunks nothing references.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from flashckpt.distributed.group.barrier import raise_failed
from flashckpt.distributed.group.context import DistContext
from flashckpt.errors import DistributedError
from flashckpt.store.gc import collect_garbage
from flashckpt.store.store import CheckpointStore, part_name

log = logging.getLogger(__name__)
HINT = "; nothing was published and older checkpoints are intact"
ORDER = ("plan", "save", "publish", "retain", "cleanup")


class SaveAttempt:
    """The protocol state of one ``save(step)`` on this rank (see the module docstring)."""

    def __init__(self, dist: DistContext, step: int) -> None:
        self.dist = dist
        self.step = step
        self.barrier = dist.barrier("save", step)
        self.posted: str | None = None  # the last phase this rank posted
        self.tier: Any = None  # the Tier rank 0 chose
        self.stores: list[CheckpointStore] = []  # every tier's store (parts are removed there)
        self.pinned: Callable[[], set[str]] = set
        self.agreed_failure = False  # the ranks already agreed this attempt failed
        self.sweep = False  # plan: promote the node tiers' stranded steps first (runtime.py)

    @property
    def missing(self) -> bool:
        """True when a rank never arrived (cleanup then is left to the next gc)."""
        return self.barrier.timed_out

    def plan(self, tiers: Any, nbytes: int, *, swept: bool = False) -> Any:
        """Phase ``plan``: rank 0 picks the tier for every rank (``TierSet`` ``tiers``).
        ``swept``: this rank already promoted the steps stranded in its node tier since the
        memory tier was suspended (:attr:`sweep` tells whether this save must first)."""
        self.stores = [t.store for t in tiers.tiers]
        self.pinned = tiers.pinned

        first = tiers.fastest

        def decide(values: list[dict[str, Any]]) -> str | None:
            if not all(v.get("ok") for v in values):
                return None
            _suspend(first, values)  # a rank's stopped replication suspends it for everyone
            total = sum(int(v.get("nbytes", 0)) for v in values)
            return str(tiers.target(step=self.step, nbytes=total).name)

        self.posted = "plan"
        post = {"ok": True, "nbytes": nbytes, "suspended": first.suspended, "swept": swept}
        with self._agreeing():
            values, name = self.barrier.decide("plan", post, decide)
            raise_failed(values, phase="plan", step=self.step, hint=HINT)
        _suspend(first, values)
        suspended = any(v.get("suspended") for v in values)
        self.sweep = suspended and not all(v.get("swept") for v in values)
        tier = tiers.by_name(name) if isinstance(name, str) else None
        if tier is None:  # the same on every rank: they all read rank 0's answer
            self.agreed_failure = True
            raise DistributedError(
                f"checkpoint step {self.step}: rank 0 chose tier {name!r}, which this "
                "Checkpointer does not have; give every rank the same tiers" + HINT,
                phase="plan",
                ranks=[0],
            )
        self.tier = tier
        return tier

    def agree(self, phase: str, error: str | None) -> None:
        """Post ``error`` (None: ok) at ``phase``; raise the agreed error if any rank failed."""
        self.posted = phase
        with self._agreeing():
            self.barrier.agree(phase, error, step=self.step, hint=HINT)

    @contextmanager
    def _agreeing(self) -> Iterator[None]:
        try:
            yield
        except DistributedError:
            self.agreed_failure = True
            raise

    def fail(self, exc: BaseException, doing: str) -> BaseException:
        """The error every rank raises for ``exc`` on this rank: posted at the phase the others
        wait in (``plan`` before the job exists, else ``save``), unless already agreed."""
        if self.agreed_failure or self.posted not in (None, "plan"):
            return exc
        phase = "plan" if self.posted is None else "save"
        try:
            self.agree(phase, describe(doing, exc))
        except DistributedError as agreed:
            agreed.__cause__ = exc
            return agreed
        return exc  # pragma: no cover - agree raises since this rank failed

    def cleanup(self) -> None:
        """After a failure past ``plan``: parts of the step leave every tier, rank 0 collects
        garbage while the others wait. Without a rank (a timeout), the lowest rank still there
        removes every part, each rank its own (a late rank removes its own when it learns the
        outcome), and the chunks wait for a later gc."""
        if self.posted in (None, "plan"):  # nothing was written
            self.dist.finished(self.barrier)
            return
        gone = set(self.barrier.missing) if self.missing else set()
        sweeper = min((r for r in range(self.dist.world_size) if r not in gone), default=0)
        every = self.dist.rank == sweeper
        ranks = range(self.dist.world_size) if every else [self.dist.rank]
        for store in self.stores:
            for r in ranks:
                _delete(store, part_name(self.step, r))
        if self.missing:
            self.dist.finished(self.barrier)
            return
        if self.dist.rank == 0 and self.tier is not None:
            try:
                collect_garbage(self.tier.store, pinned=self.pinned())
            except Exception as exc:
                log.warning("cleanup after failed step %d: %s", self.step, exc)
        try:
            self.agree("cleanup", None)
        except DistributedError as exc:
            log.warning("cleanup barrier after failed step %d: %s", self.step, exc)
        self.dist.finished(self.barrier)


def _suspend(tier: Any, values: list[dict[str, Any]]) -> None:
    """Suspend ``tier`` (the fastest) when any rank posted it suspended (its replication
    stopped: the node-local steps would be lost with the node), so that rank 0's tier choice
    sees every rank's suspension (the same values, so the same choice, on every rank)."""
    reasons = [f"rank {r}: {v['suspended']}" for r, v in enumerate(values) if v.get("suspended")]
    if reasons and tier.suspended is None:
        tier.suspended = "; ".join(reasons)


def describe(doing: str, exc: BaseException) -> str:
    return f"{doing}: {type(exc).__name__}: {exc}"


def _delete(store: CheckpointStore, name: str) -> None:
    try:
        store.backend.delete(name)
    except FileNotFoundError:
        pass
    except Exception as exc:
        log.warning("could not delete %s in %s: %s", name, store.url, exc)
