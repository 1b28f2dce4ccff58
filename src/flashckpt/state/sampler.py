"""A sampler whose position survives a restart exactly, even with DataLoader workers.

A DataLoader with workers asks its sampler for indices ahead of the training loop (each worker
prefetches ``prefetch_factor`` batches), so counting what the sampler *yielded* over-counts
what the loop *consumed*. :class:`ResumableSampler` therefore counts consumption where it
happens: the training loop iterates ``sampler.wrap(loader)``, which passes batches through and
advances the position by one batch each time it hands a batch to the loop.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator, Mapping, Sized
from typing import Any

import torch
from torch.utils.data import BatchSampler, DataLoader, Sampler

from flashckpt.errors import ConfigError, StateMismatchError

logger = logging.getLogger(__name__)

_VERSION = 1
_INT_FIELDS = ("version", "epoch", "start", "consumed", "num_replicas", "rank", "dataset_len")
_BOOL_FIELDS = ("shuffle", "drop_last")
_MUST_MATCH = ("dataset_len", "shuffle", "seed", "drop_last")


def _check_int(name: str, value: Any, *, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"ResumableSampler: {name} must be an int >= {minimum}, got {value!r}")
    return value


class ResumableSampler(Sampler[int]):
    """Shuffled (or sequential) sampler that resumes at the exact next sample.

    Usage::

        sampler = ResumableSampler(dataset, shuffle=True, seed=0)
        loader = DataLoader(dataset, batch_size=16, sampler=sampler, num_workers=2)
        state = {"model": model, "optim": opt, "data": sampler, "rng": flashckpt.RNG()}
        ckpt.restore(state)
        for epoch in range(sampler.epoch, num_epochs):
            sampler.set_epoch(epoch)                  # no-op when resuming into this epoch
            for x, y in sampler.wrap(loader):         # counts what the loop consumed
                ...                                   # train step; ckpt.save(step, state)

    **Position.** ``state_dict()`` records the epoch and the number of samples the training
    loop has *received* through :meth:`wrap` (one full batch per batch, the last batch of an
    epoch may be short). It is exact for any ``num_workers`` and prefetching, because workers
    only run ahead of the sampler, never of ``wrap``. When the wrapped loader is exhausted the
    epoch is complete and the sampler moves to the next one by itself; calling
    ``set_epoch(e)`` with the current epoch changes nothing, with another epoch starts that
    epoch from its first sample. Iterating the loader without ``wrap`` still works, but then
    the position cannot advance (a warning is logged on ``state_dict``). Checkpoint between
    batches, i.e. after the step that used the last batch ``wrap`` returned.

    **Order.** Epoch ``e`` uses ``torch.randperm(len(dataset))`` from a ``torch.Generator``
    seeded with ``seed + e`` (``range(len(dataset))`` when ``shuffle=False``).

    **Distributed** (``num_replicas``, ``rank``), as ``DistributedSampler``: the epoch's order
    is padded by repeating its head to a multiple of ``num_replicas`` (or its tail is dropped
    with ``drop_last=True``) and rank ``r`` takes every ``num_replicas``-th index starting at
    ``r``. The position is per rank; all ranks are assumed to consume the same number of
    samples (synchronous data parallel), so rank ``r`` saving ``consumed = c`` means the first
    ``c * num_replicas`` indices of the epoch were used. **Changing the world size** on
    resume: the remaining indices of the current epoch (after those first
    ``c * num_replicas``) are re-striped over the new ``num_replicas`` (padded or trimmed
    again), so no sample is repeated or skipped apart from padding; the next epoch starts
    normally. Any rank's saved state can be loaded by any rank of the new world.

    ``drop_last`` only concerns this distributed striping; the DataLoader's own
    ``drop_last`` (short final batch) is honoured by ``wrap`` as well.
    """

    def __init__(
        self,
        data_source: Sized,
        *,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        num_replicas: int = 1,
        rank: int = 0,
    ) -> None:
        if not hasattr(data_source, "__len__"):
            raise ConfigError("ResumableSampler: data_source must have a length (map-style)")
        self.data_source = data_source
        self.shuffle = bool(shuffle)
        self.seed = _check_int("seed", seed, minimum=0)
        self.drop_last = bool(drop_last)
        self.num_replicas = _check_int("num_replicas", num_replicas, minimum=1)
        self.rank = _check_int("rank", rank, minimum=0)
        if rank >= num_replicas:
            raise ConfigError(
                f"ResumableSampler: rank must be < num_replicas ({num_replicas}), got {rank}"
            )
        self.epoch = 0
        self.start = 0  # offset into the epoch's order where the current striping begins
        self.consumed = 0  # samples this rank's training loop received since `start`
        self._pass_len: int | None = None  # length of the pass in progress
        self._wrapping = False
        self._untracked = False

    # -- order ---------------------------------------------------------------------------
    def _epoch_order(self) -> list[int]:
        n = len(self.data_source)
        if not self.shuffle:
            return list(range(n))
        g = torch.Generator()
        g.manual_seed(self.seed + self.epoch)
        return torch.randperm(n, generator=g).tolist()

    def _segment_len(self, remaining: int, replicas: int) -> int:
        """Per-rank number of indices when ``remaining`` indices are striped."""
        if remaining <= 0:
            return 0
        if self.drop_last:
            return remaining // replicas
        return math.ceil(remaining / replicas)

    def _rank_indices(self) -> list[int]:
        segment = self._epoch_order()[self.start :]
        per_rank = self._segment_len(len(segment), self.num_replicas)
        total = per_rank * self.num_replicas
        if total > len(segment):  # pad by repeating the head, as DistributedSampler does
            reps = math.ceil((total - len(segment)) / len(segment))
            segment = segment + (segment * reps)[: total - len(segment)]
        return segment[:total][self.rank :: self.num_replicas]

    def _rank_len(self) -> int:
        remaining = len(self.data_source) - self.start
        return self._segment_len(remaining, self.num_replicas)

    # -- Sampler protocol ----------------------------------------------------------------
    def __iter__(self) -> Iterator[int]:
        indices = self._rank_indices()[self.consumed :]
        self._pass_len = len(indices)
        if not self._wrapping:
            self._untracked = True
        return iter(indices)

    def __len__(self) -> int:
        """Indices in the pass in progress, else in the next pass (the rest of this epoch)."""
        if self._pass_len is not None:
            return self._pass_len
        return max(0, self._rank_len() - self.consumed)

    def set_epoch(self, epoch: int) -> None:
        """Select ``epoch``; a different epoch than the current one starts at its beginning."""
        _check_int("epoch", epoch, minimum=0)
        if epoch != self.epoch:
            self.epoch = epoch
            self.start = 0
            self.consumed = 0
            self._pass_len = None

    # -- consumption tracking ------------------------------------------------------------
    def wrap(self, loader: DataLoader[Any]) -> Iterator[Any]:
        """Iterate ``loader`` (a DataLoader using this sampler), counting consumed samples.

        Advances :attr:`consumed` by the loader's batch size each time a batch is handed to
        the caller, and moves to the next epoch when the loader is exhausted.
        """
        batch_size = self._loader_batch_size(loader)
        full = self._rank_len()
        self._wrapping = True
        try:
            for batch in loader:
                self.consumed = min(self.consumed + batch_size, full)
                yield batch
        finally:
            self._wrapping = False
            self._pass_len = None
        self._next_epoch()

    def _loader_batch_size(self, loader: Any) -> int:
        if not isinstance(loader, DataLoader):
            raise ConfigError(
                f"ResumableSampler.wrap: expected a torch DataLoader, got {type(loader).__name__}"
            )
        batch_sampler = loader.batch_sampler
        if loader.sampler is not self and getattr(batch_sampler, "sampler", None) is not self:
            raise ConfigError(
                "ResumableSampler.wrap: the loader does not use this sampler; build it with "
                "DataLoader(dataset, sampler=this_sampler, batch_size=...)"
            )
        if batch_sampler is None:
            return 1
        if isinstance(batch_sampler, BatchSampler):
            return int(batch_sampler.batch_size)
        raise ConfigError(
            "ResumableSampler.wrap: the loader uses a custom batch_sampler of type "
            f"{type(batch_sampler).__name__}; use batch_size= or a torch BatchSampler"
        )

    def _next_epoch(self) -> None:
        self._pass_len = None
        self.epoch += 1
        self.start = 0
        self.consumed = 0

    # -- Stateful ------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Position and the settings it depends on; JSON-able ints and bools only."""
        if self._untracked and not self._wrapping:
            logger.warning(
                "ResumableSampler was iterated without sampler.wrap(loader); the saved position "
                "is where that pass started, not what the training loop consumed"
            )
        return {
            "version": _VERSION,
            "epoch": self.epoch,
            "start": self.start,
            "consumed": self.consumed,
            "num_replicas": self.num_replicas,
            "rank": self.rank,
            "dataset_len": len(self.data_source),
            "seed": self.seed,
            "shuffle": self.shuffle,
            "drop_last": self.drop_last,
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Resume at the saved position; re-stripe if ``num_replicas`` changed."""
        state = _validate(state_dict)
        mine = self.state_dict()
        wrong = [k for k in _MUST_MATCH if state[k] != mine[k]]
        if wrong:
            detail = ", ".join(f"{k}: saved {state[k]!r}, now {mine[k]!r}" for k in wrong)
            raise StateMismatchError(
                f"ResumableSampler state does not fit this sampler ({detail}); build the "
                "sampler with the same dataset and settings as the saved run",
                keys=wrong,
            )
        self.epoch, self.start, self.consumed = state["epoch"], state["start"], state["consumed"]
        if state["num_replicas"] != self.num_replicas:
            self._restripe(old_replicas=state["num_replicas"])
        self._pass_len = None
        self._untracked = False

    def _restripe(self, *, old_replicas: int) -> None:
        n = len(self.data_source)
        old_len = self._segment_len(n - self.start, old_replicas)
        if self.consumed >= old_len:
            new_start = n  # that epoch was finished
        else:
            new_start = min(n, self.start + self.consumed * old_replicas)
        logger.info(
            "ResumableSampler: num_replicas changed %d -> %d in epoch %d; re-striping the "
            "%d remaining samples of the epoch",
            old_replicas,
            self.num_replicas,
            self.epoch,
            n - new_start,
        )
        self.start, self.consumed = new_start, 0


def _validate(state_dict: Mapping[str, Any]) -> dict[str, Any]:
    if not isinstance(state_dict, Mapping):
        raise StateMismatchError(
            f"ResumableSampler state must be a dict, got {type(state_dict).__name__}"
        )
    missing = [k for k in (*_INT_FIELDS, *_BOOL_FIELDS, "seed") if k not in state_dict]
    if missing:
        raise StateMismatchError(f"ResumableSampler state lacks {missing}", keys=missing)
    state = dict(state_dict)
    for key in (*_INT_FIELDS, "seed"):
        value = state[key]
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise StateMismatchError(
                f"ResumableSampler state {key!r} must be an int >= 0, got {value!r}", keys=[key]
            )
    for key in _BOOL_FIELDS:
        if not isinstance(state[key], bool):
            raise StateMismatchError(
                f"ResumableSampler state {key!r} must be a bool, got {state[key]!r}", keys=[key]
            )
    if state["version"] != _VERSION:
        raise StateMismatchError(
            f"ResumableSampler state version {state['version']} is not supported "
            f"(this flashckpt writes version {_VERSION})",
            keys=["version"],
        )
    if state["num_replicas"] < 1 or state["start"] > state["dataset_len"]:
        raise StateMismatchError(
            "ResumableSampler state is inconsistent (num_replicas < 1 or start past the end)"
        )
    return state


__all__ = ["ResumableSampler"]
