"""ResumableSampler resumes at the exact next sample; StatefulDataLoader state is plain data."""

from __future__ import annotations

import json
import logging
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, Dataset

from flashckpt.errors import ConfigError, StateMismatchError
from flashckpt.state.sampler import ResumableSampler


class IndexDataset(Dataset[torch.Tensor]):
    """Each sample is its own index, so batches show which samples were used."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor(i)


def _plain(tree: Any) -> Any:
    """Checkpoint round trip; fails on anything that is not tensor/ndarray/JSON-able."""
    if isinstance(tree, torch.Tensor):
        return tree.clone()
    if isinstance(tree, np.ndarray):
        return tree.copy()
    if isinstance(tree, dict):
        bad = [k for k in tree if not isinstance(k, str)]
        assert not bad, f"non-string keys {bad!r}"
        return {k: _plain(v) for k, v in tree.items()}
    assert not isinstance(tree, tuple), f"tuple {tree!r}"
    if isinstance(tree, list):
        return [_plain(v) for v in tree]
    assert tree is None or isinstance(tree, (int, float, str, bool)), f"{type(tree)}: {tree!r}"
    return json.loads(json.dumps(tree))


def _make(n: int, batch: int, workers: int, **kw: Any) -> tuple[ResumableSampler, DataLoader]:
    drop = kw.pop("loader_drop_last", False)
    ds = IndexDataset(n)
    sampler = ResumableSampler(ds, **kw)
    loader = DataLoader(ds, batch_size=batch, sampler=sampler, num_workers=workers, drop_last=drop)
    return sampler, loader


def _take(sampler: ResumableSampler, loader: DataLoader, n_batches: int) -> list[list[int]]:
    out: list[list[int]] = []
    while len(out) < n_batches:
        for batch in sampler.wrap(loader):
            out.append(batch.tolist())
            if len(out) == n_batches:
                break
    return out


def _flat(batches: list[list[int]]) -> list[int]:
    return [i for batch in batches for i in batch]


@pytest.mark.parametrize(
    ("workers", "k", "kw"),
    [
        (0, 3, {}),
        (0, 10, {}),  # exactly at the end of epoch 0
        (0, 13, {"loader_drop_last": True}),
        (0, 7, {"shuffle": False}),
        (2, 4, {}),
        (2, 13, {"seed": 7}),
    ],
)
def test_resume_continues_at_the_exact_next_sample(workers: int, k: int, kw: dict) -> None:
    n, batch, total = 37, 4, 25  # 10 batches per epoch (last one short): crosses 2 epochs
    straight = _take(*_make(n, batch, workers, **kw), total)

    sampler, loader = _make(n, batch, workers, **kw)
    first = _take(sampler, loader, k)
    state = _plain(sampler.state_dict())
    del sampler, loader

    sampler2, loader2 = _make(n, batch, workers, **kw)
    sampler2.load_state_dict(state)
    rest = _take(sampler2, loader2, total - k)
    assert first + rest == straight


def test_epochs_are_permutations_seeded_by_seed_plus_epoch() -> None:
    sampler, loader = _make(37, 4, 0, seed=3)
    epochs = [[i for b in sampler.wrap(loader) for i in b.tolist()] for _ in range(2)]
    for e, order in enumerate(epochs):
        g = torch.Generator()
        g.manual_seed(3 + e)
        assert order == torch.randperm(37, generator=g).tolist()
    assert epochs[0] != epochs[1]
    assert sampler.epoch == 2


def test_set_epoch_same_epoch_keeps_position_other_epoch_restarts() -> None:
    sampler, loader = _make(37, 4, 0)
    _take(sampler, loader, 3)
    sampler.set_epoch(0)
    assert sampler.consumed == 12
    assert len(sampler) == 37 - 12
    sampler.set_epoch(5)
    assert (sampler.epoch, sampler.consumed, len(sampler)) == (5, 0, 37)


def test_user_driven_epoch_loop_resumes_exactly() -> None:
    def run(sampler: ResumableSampler, loader: DataLoader, stop: int | None) -> list[int]:
        seen: list[int] = []
        for epoch in range(sampler.epoch, 3):
            sampler.set_epoch(epoch)
            for batch in sampler.wrap(loader):
                seen += batch.tolist()
                if stop is not None and len(seen) >= stop:
                    return seen
        return seen

    straight = run(*_make(20, 3, 0), None)
    s1, l1 = _make(20, 3, 0)
    head = run(s1, l1, 27)
    s2, l2 = _make(20, 3, 0)
    s2.load_state_dict(_plain(s1.state_dict()))
    assert head + run(s2, l2, None) == straight


def _dist_take(n: int, replicas: int, batches: int, state: dict | None = None) -> list[list[int]]:
    """Every rank takes `batches` batches of 2; returns each rank's samples."""
    out = []
    for rank in range(replicas):
        sampler, loader = _make(n, 2, 0, num_replicas=replicas, rank=rank, seed=1)
        if state is not None:
            sampler.load_state_dict(state)
        out.append(_flat(_take(sampler, loader, batches)))
    return out


def test_distributed_ranks_stripe_the_epoch_and_resume_per_rank() -> None:
    straight = _dist_take(21, 2, 8)  # 11 per rank, padded by one: crosses into epoch 1
    epoch0 = straight[0][:11] + straight[1][:11]
    assert set(epoch0) == set(range(21))
    assert len(epoch0) == 22  # one padding repeat
    for rank in range(2):
        s, loader = _make(21, 2, 0, num_replicas=2, rank=rank, seed=1)
        head = _flat(_take(s, loader, 3))
        s2, l2 = _make(21, 2, 0, num_replicas=2, rank=rank, seed=1)
        s2.load_state_dict(_plain(s.state_dict()))
        assert head + _flat(_take(s2, l2, 5)) == straight[rank]


def test_world_size_change_restripes_the_rest_of_the_epoch() -> None:
    s, loader = _make(20, 2, 0, num_replicas=2, rank=1, seed=1)
    _take(s, loader, 3)  # each of 2 ranks consumed 6 -> first 12 of the epoch are used
    state = _plain(s.state_dict())
    g = torch.Generator()
    g.manual_seed(1)
    order = torch.randperm(20, generator=g).tolist()

    after = _dist_take(20, 3, 2, state)  # 8 left -> padded to 9 -> 3 per rank (2 batches)
    rest = sorted(_flat(after))
    assert set(rest) == set(order[12:])
    assert len(rest) == 9  # one padding repeat, nothing else repeated
    # the next epoch is an ordinary 3-way epoch
    s3, l3 = _make(20, 2, 0, num_replicas=3, rank=0, seed=1)
    s3.load_state_dict(state)
    _take(s3, l3, 2)
    fresh, lf = _make(20, 2, 0, num_replicas=3, rank=0, seed=1)
    fresh.set_epoch(1)
    assert _take(s3, l3, 4) == _take(fresh, lf, 4)


def test_world_size_change_after_a_finished_epoch_starts_the_next() -> None:
    s, loader = _make(20, 2, 0, num_replicas=2, rank=0, seed=1)
    _take(s, loader, 5)  # all 10 of this rank's samples, epoch not yet advanced
    s2, l2 = _make(20, 2, 0, num_replicas=4, rank=0, seed=1)
    s2.load_state_dict(_plain(s.state_dict()))
    fresh, lf = _make(20, 2, 0, num_replicas=4, rank=0, seed=1)
    fresh.set_epoch(1)
    assert _take(s2, l2, 2) == _take(fresh, lf, 2)


@pytest.mark.parametrize(
    ("change", "value", "key"),
    [
        ("n", 38, "dataset_len"),
        ("seed", 1, "seed"),
        ("shuffle", False, "shuffle"),
        ("drop_last", True, "drop_last"),
    ],
)
def test_state_for_a_different_setup_raises(change: str, value: Any, key: str) -> None:
    state = ResumableSampler(IndexDataset(37), seed=0).state_dict()
    kw: dict[str, Any] = {"seed": 0}
    n = 37
    if change == "n":
        n = value
    else:
        kw[change] = value
    with pytest.raises(StateMismatchError, match=key) as info:
        ResumableSampler(IndexDataset(n), **kw).load_state_dict(state)
    assert info.value.keys == [key]


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        ({"consumed": "3"}, "consumed"),
        ({"shuffle": 1}, "shuffle"),
        ({"version": 99}, "version"),
        ({"start": 500}, "inconsistent"),
        ({"epoch": -1}, "epoch"),
    ],
)
def test_malformed_state_raises(edit: dict, match: str) -> None:
    sampler = ResumableSampler(IndexDataset(37))
    state = {**sampler.state_dict(), **edit}
    with pytest.raises(StateMismatchError, match=match):
        sampler.load_state_dict(state)
    assert sampler.epoch == 0


def test_missing_keys_raise() -> None:
    sampler = ResumableSampler(IndexDataset(5))
    state = sampler.state_dict()
    del state["consumed"]
    with pytest.raises(StateMismatchError, match="consumed"):
        sampler.load_state_dict(state)
    with pytest.raises(StateMismatchError, match="must be a dict"):
        sampler.load_state_dict([1])  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"rank": 2, "num_replicas": 2}, "rank"),
        ({"num_replicas": 0}, "num_replicas"),
        ({"seed": -1}, "seed"),
        ({"seed": 1.5}, "seed"),
    ],
)
def test_bad_arguments_raise_config_error(kw: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        ResumableSampler(IndexDataset(5), **kw)


def test_wrap_rejects_foreign_loaders() -> None:
    ds = IndexDataset(8)
    sampler = ResumableSampler(ds)
    with pytest.raises(ConfigError, match="does not use this sampler"):
        next(sampler.wrap(DataLoader(ds, batch_size=2)))
    with pytest.raises(ConfigError, match="DataLoader"):
        next(sampler.wrap([1, 2]))  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="epoch"):
        sampler.set_epoch(-1)


def test_wrap_accepts_an_explicit_batch_sampler() -> None:
    ds = IndexDataset(10)
    sampler = ResumableSampler(ds, shuffle=False)
    loader = DataLoader(ds, batch_sampler=BatchSampler(sampler, batch_size=3, drop_last=False))
    first = next(sampler.wrap(loader))
    assert first.tolist() == [0, 1, 2]
    assert sampler.consumed == 3


def test_iterating_without_wrap_warns_on_save(caplog: pytest.LogCaptureFixture) -> None:
    sampler, loader = _make(8, 2, 0)
    list(loader)
    with caplog.at_level(logging.WARNING, logger="flashckpt.state.sampler"):
        state = sampler.state_dict()
    assert "without sampler.wrap" in caplog.text
    assert state["consumed"] == 0


# -- torchdata's StatefulDataLoader as an ordinary Stateful ----------------------------------


@pytest.mark.parametrize("workers", [0, 2])
def test_stateful_dataloader_state_is_plain_and_resumes(workers: int) -> None:
    from torchdata.stateful_dataloader import StatefulDataLoader

    def make() -> StatefulDataLoader:
        torch.manual_seed(0)  # RandomSampler draws its seed from the global generator
        return StatefulDataLoader(IndexDataset(23), batch_size=4, shuffle=True, num_workers=workers)

    straight = [b.tolist() for b in make()]
    loader = make()
    assert _plain(loader.state_dict()) is not None  # before any iteration
    it = iter(loader)
    head = [next(it).tolist() for _ in range(3)]
    state = _plain(loader.state_dict())  # raises on tuples, non-str keys, other types
    del it, loader
    resumed = make()
    resumed.load_state_dict(state)
    assert head + [b.tolist() for b in resumed] == straight
    assert _plain(resumed.state_dict()) is not None  # after a finished epoch
