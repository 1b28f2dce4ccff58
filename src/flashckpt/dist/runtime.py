"""What the Checkpointer calls when it runs under torch.distributed (one object, few hooks).

``Checkpointer`` holds a :class:`DistRuntime` (None outside torch.distributed) and calls:

1. ``split(captured, state)`` in ``save()`` after capture: drop what other ranks write, rename
   per-rank tensors (:mod:`flashckpt.dist.ownership`);
2. ``job(...)`` instead of building a plain ``SaveJob``: the job commits with the distributed
   protocol (:mod:`flashckpt.dist.commit`);
3. ``restore(...)`` from ``restore()``: all ranks agree on the step (:mod:`flashckpt.dist.restore`).
"""

from __future__ import annotations

import os
import uuid
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from flashckpt.dist.commit import DistSaveJob
from flashckpt.dist.context import DistContext
from flashckpt.dist.ownership import split_for_rank
from flashckpt.dist.restore import init_sharded_optimizers, restore_agreed
from flashckpt.errors import ConfigError
from flashckpt.journal import Journal
from flashckpt.state.capture import Captured
from flashckpt.store.store import CheckpointStore


class DistRuntime:
    def __init__(self, ctx: DistContext) -> None:
        self.ctx = ctx
        self._per_rank: list[str] = []
        self._decided: tuple[int, str] | None = None

    @classmethod
    def detect(
        cls, *, process_group: Any = None, timeout_s: float = 300.0, on_busy: str = "wait"
    ) -> DistRuntime | None:
        ctx = DistContext.detect(process_group=process_group, timeout_s=timeout_s)
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
        """Every rank must see the same directory for each local tier (``{tier: dir}``): the
        ranks commit one checkpoint together and rank 0 merges their parts. Rank 0 drops a
        marker file in each; the others look for it. A directory that is node-local on a
        multi-node run (a memory tier in /dev/shm, a root on a local disk) is a ConfigError
        on every rank, here rather than at the first save."""
        barrier = self.ctx.barrier("shared-dirs")
        token, error = "", None
        if self.rank == 0:
            token = uuid.uuid4().hex
            try:
                for d in dirs.values():
                    (d / f".flashckpt-shared-{token}").touch()
            except OSError as exc:
                error = f"rank 0 cannot write a marker in {exc.filename}: {exc.strerror}"
        token = barrier.exchange("mark", {"token": token, "error": error})[0]["token"]
        unseen = [
            name
            for name, d in dirs.items()
            if self.rank != 0 and not (d / f".flashckpt-shared-{token}").exists()
        ]
        seen = barrier.exchange("look", {"unseen": unseen, "error": error})
        if self.rank == 0:
            for d in dirs.values():
                try:
                    os.unlink(d / f".flashckpt-shared-{token}")
                except OSError:
                    pass
        if seen[0]["error"]:
            raise ConfigError(seen[0]["error"])
        bad = {r: v["unseen"] for r, v in enumerate(seen) if v["unseen"]}
        if bad:
            what = "; ".join(
                f"rank {r} cannot see rank 0's {', '.join(f'{n} tier {dirs[n]}' for n in names)}"
                for r, names in bad.items()
            )
            raise ConfigError(
                f"checkpoint directories are not shared by all ranks ({what}). Under "
                "torch.distributed the root must be on a filesystem every rank sees, and a "
                "memory_tier (e.g. /dev/shm) works only when all ranks run on one node; "
                "drop memory_tier= on multi-node runs"
            )

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

    def split(self, captured: Captured, state: Mapping[str, Any]) -> None:
        self._per_rank = split_for_rank(
            captured, state, rank=self.ctx.rank, world_size=self.ctx.world_size
        )

    def job(self, *, retain: Callable[[], None] | None, **kwargs: Any) -> DistSaveJob:
        return DistSaveJob(dist=self.ctx, per_rank=self._per_rank, retain=retain, **kwargs)

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
        init_sharded_optimizers(state)

        def on_corrupt(cand: int, msg: str) -> None:
            warnings.warn(f"skipping damaged checkpoint step {cand}: {msg}", stacklevel=4)
            journal.append("corrupt", step=cand, tier="local", error=msg)

        return restore_agreed(
            self.ctx, store, step=step, steps=steps, load=load, on_corrupt=on_corrupt
        )
