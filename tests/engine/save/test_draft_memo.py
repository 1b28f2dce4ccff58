"""A save laid out like the one before reuses its manifest draft (engine/save/manifests.py),
and only then: any change of key, dtype, shape or layout makes a new one."""

from __future__ import annotations

import pytest
import torch

import flashckpt
from flashckpt.engine.save import manifests
from flashckpt.store.files.backend import LocalBackend
from flashckpt.store.store import CheckpointStore


def _state(seed: int, **change: torch.Tensor) -> dict:
    g = torch.Generator().manual_seed(seed)
    sd = {f"p{i}": torch.randn(5, generator=g) for i in range(20)}
    sd["big"] = torch.randn(3, 7, generator=g)
    sd.update(change)
    return {"m": sd, "bare": torch.randn(4, generator=g)}


@pytest.fixture
def made(monkeypatch) -> list[int]:
    """How many drafts were made from scratch."""
    calls: list[int] = []
    real = manifests._tensors

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(manifests, "_tensors", counting)
    return calls


def _check(root, step: int, state: dict) -> None:
    out = {
        "m": {k: torch.zeros_like(v) for k, v in state["m"].items()},
        "bare": torch.zeros_like(state["bare"]),
    }
    with flashckpt.Checkpointer(root) as ck:
        assert ck.restore(out, step=step) == step
    assert torch.equal(out["bare"], state["bare"])
    for k, v in state["m"].items():
        assert out["m"][k].dtype == v.dtype and torch.equal(out["m"][k], v), k
    manifest = CheckpointStore(LocalBackend(root)).load_manifest(step)
    assert {k: e.global_shape for k, e in manifest.tensors.items()} == {
        "m/" + k: tuple(v.shape) for k, v in state["m"].items()
    } | {"bare": tuple(state["bare"].shape)}


@pytest.mark.parametrize("async_save", [False, True])
def test_same_layout_reuses_the_draft(tmp_path, made: list[int], async_save: bool) -> None:
    states = [_state(s) for s in range(3)]
    with flashckpt.Checkpointer(tmp_path, async_save=async_save, incremental=False) as ck:
        for step, state in enumerate(states, 1):
            ck.save(step, state).wait()
    assert len(made) == 1  # the first save only
    for step, state in enumerate(states, 1):
        _check(tmp_path, step, state)


@pytest.mark.parametrize(
    "change",
    [
        {"p3": torch.randn(6)},  # a shape
        {"p3": torch.randn(5).double()},  # a dtype
        {"big": torch.randn(7, 3)},  # the same bytes, another shape
        {"extra": torch.randn(2)},  # one more tensor
    ],
    ids=["shape", "dtype", "transposed", "added"],
)
def test_a_changed_layout_makes_a_new_draft(tmp_path, made: list[int], change: dict) -> None:
    first, second = _state(0), _state(1, **change)
    with flashckpt.Checkpointer(tmp_path, incremental=False) as ck:
        ck.save(1, first)
        ck.save(2, second)
    assert len(made) == 2
    _check(tmp_path, 1, first)
    _check(tmp_path, 2, second)


def test_a_renamed_key_makes_a_new_draft(tmp_path, made: list[int]) -> None:
    first = _state(0)
    second = _state(1)
    second["m"]["q3"] = second["m"].pop("p3")  # (same layout otherwise: q3 is now last)
    third = _state(2)
    third["m"] = {("r" + k if k == "p3" else k): v for k, v in third["m"].items()}  # same place
    with flashckpt.Checkpointer(tmp_path, incremental=False) as ck:
        for step, state in enumerate((first, second, third), 1):
            ck.save(step, state)
    assert len(made) == 3
    for step, state in enumerate((first, second, third), 1):
        _check(tmp_path, step, state)
