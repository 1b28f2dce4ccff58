"""What the Checkpointer calls when it runs under torch.distributed (one object, few hooks).

``Checkpointer`` holds a :class:`DistRuntime` (None outside torch.distributed) and calls:

1. ``begin_save(step)`` first thing in ``save()``: the attempt of this save
   (:mod:`flashckpt.dist.attempt`); any exception ``save()`` raises before its job exists goes
   through ``failed(exc)``, which posts it so every rank raises the same error at once;
2. ``split(captured, state)`` after capture: validate DTensor placements, drop what other ranks
   write, rename per-rank tensors (:mod:`flashckpt.dist.ownership`);
3. ``tier(tiers, nbytes)`` instead of ``TierSet.target``: rank 0 picks the tier for all ranks;
4. ``job(...)`` instead of building a plain ``SaveJob``: the job commits with the distributed
   protocol (:mod:`flashckpt.dist.commit`);
5. ``restore(...)`` from ``restore()``: all ranks agree on the step (:mod:`flashckpt.dist.restore`).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

from flashckpt.dist.attempt import SaveAttempt
from flashckpt.dist.commit import DistSaveJob
from flashckpt.dist.context import DistContext
from flashckpt.dist.ownership import split_for_rank
from flashckpt.dist.restore import restore_agreed
from flashckpt.dist.shared import check_shared
from flashckpt.errors import ConfigError
from flashckpt.journal import Journal
from flashckpt.state.capture import Captured
from flashckpt.store.store import CheckpointStore


T = TypeVar("T")

class DistRuntime:
    def __init__(self, ctx: DistContext) -> None:
        self.ctx = ctx
        self._per_rank: list[str] = []
        self._decided: tuple[int, str] | None = None
        self._attempt: SaveAttempt | None = None

    @classmethod
    def detect(
        cls,
        *,
        process_group: Any = None,
        timeout_s: float = 300.0,
        on_busy: str = "wait",
        root: str | os.PathLike[str] = "",
        name: str | None = None,
    ) -> DistRuntime | None:
        ctx = DistContext.detect(
            process_group=process_group, timeout_s=timeout_s, root=str(root), name=name
        )
        if ctx is None:
            return None
        if on_busy == "skip":
            raise ConfigError(
                "on_busy='skip' cannot be used under torch.distributed: ranks could skip "
                "different steps and wait for each other; use on_busy='wait'"
            )
        return cls(ctx)

    @property
    def rank(self) -> int:
        return self.ctx.rank

    @property
    def world_size(self) -> int:
        return self.ctx.world_size

    @property
    def lock_name(self) -> str:
        return f"rank-{self.ctx.rank}"

    def check_shared(self, dirs: Mapping[str, Path]) -> None:
        """Every rank must see the same directory for each local tier (``{tier: dir}``);
        see :func:`flashckpt.dist.shared.check_shared`."""
        check_shared(self.ctx, dirs)

    def verdict(self, step: int, *, stop: bool, save: Callable[[], bool]) -> str:
        """What every rank does after ``step``: "preempt" when rank 0 was signalled (``stop``
        on rank 0), else "save" or "skip" by rank 0's save policy (``save()``)."""
        return self.agreed(step, lambda: "preempt" if stop else ("save" if save() else "skip"))

    def agreed(self, step: int, decide: Callable[[], str]) -> str:
        """Rank 0's verdict for ``step`` (a short word: "save", "skip", "preempt") on every
        rank, for the decisions ranks could take differently: clock-based save policies, and
        SIGTERM arriving at each rank at its own step (ranks that save different steps wait
        for each other at the commit barrier until it times out). Rank 0 runs ``decide`` and
        posts the verdict in the c10d Store; the others wait for it (one Store round trip per
        step); the last reader deletes the key."""
        if self._decided is not None and self._decided[0] == step:
            return self._decided[1]  # asked twice for one step: the same answer
        store, key = self.ctx.store, f"{self.ctx.name}/should-save/{step}"
        if self.rank == 0:
            verdict = decide()
            store.set(key, verdict.encode())
        else:
            verdict = bytes(store.get(key)).decode()  # waits up to the Store's timeout
            if store.add(f"{key}/read", 1) == self.world_size - 1:
                store.delete_key(key)
                store.delete_key(f"{key}/read")
        self._decided = (step, verdict)
        return verdict

    # -- saving -------------------------------------------------------------------------------
    def run_save(self, step: int, save: Callable[[], T]) -> T:
        """``save()`` of ``step`` under the agreement: :meth:`begin_save` first, and any error
        of this rank (before or after its job exists) becomes the one every rank raises."""
        self.begin_save(step)
        try:
            return save()
        except Exception as exc:
            agreed = self.failed(exc)
            if agreed is exc:
                raise
            raise agreed from exc

    def begin_save(self, step: int) -> SaveAttempt:
        """The attempt of ``save(step)`` on this rank; call before anything that may raise."""
        self._attempt = SaveAttempt(self.ctx, step)
        return self._attempt

    def failed(self, exc: BaseException) -> BaseException:
        """What ``save()`` raises for ``exc`` raised before its job existed: the error every
        rank agrees on (this rank's cause attached), after removing what was written."""
        attempt = self._attempt
        if attempt is None:
            return exc
        self._attempt = None
        agreed = attempt.fail(exc, "preparing the save")
        attempt.cleanup()
        return agreed

    def split(self, captured: Captured, state: Mapping[str, Any]) -> None:
        self._per_rank = split_for_rank(
            captured, state, rank=self.ctx.rank, world_size=self.ctx.world_size
        )

    def tier(self, tiers: Any, nbytes: int) -> Any:
        """The tier of this save, chosen by rank 0 for every rank (phase ``plan``)."""
        return self._require_attempt().plan(tiers, nbytes)

    def job(self, *, retain: Callable[[], None] | None, **kwargs: Any) -> DistSaveJob:
        attempt = self._require_attempt()
        job = DistSaveJob(attempt=attempt, per_rank=self._per_rank, retain=retain, **kwargs)
        self._attempt = None  # from here on the job posts its failures
        return job

    def _require_attempt(self) -> SaveAttempt:
        if self._attempt is None:
            raise RuntimeError("DistRuntime.begin_save() must come first")  # a flashckpt bug
        return self._attempt

    def restore(
        self,
        store: CheckpointStore,
        journal: Journal,
        state: Mapping[str, Any],
        *,
        step: int | None,
        steps: list[int],
        load: Callable[[int], Any],
    ) -> int | None:
        """``steps``: the steps this rank can see (rank 0's list decides);
        ``load(step)`` loads one step into ``state`` on this rank."""

        def on_corrupt(cand: int, msg: str) -> None:
            warnings.warn(f"skipping damaged checkpoint step {cand}: {msg}", stacklevel=4)
            journal.append("corrupt", step=cand, tier="local", error=msg)

        return restore_agreed(
            self.ctx, store, step=step, steps=steps, load=load, on_corrupt=on_corrupt, state=state
        )
