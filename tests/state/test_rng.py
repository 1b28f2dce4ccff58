"""RNG round trips give identical random streams afterwards."""

from __future__ import annotations

import json
import logging
import random
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from flashckpt.errors import StateMismatchError
from flashckpt.state.rng import RNG


def _round_trip(tree: Any) -> Any:
    """What a checkpoint does: tensors and arrays are copied, the rest goes through JSON."""
    if isinstance(tree, torch.Tensor):
        return tree.clone()
    if isinstance(tree, np.ndarray):
        return tree.copy()
    if isinstance(tree, dict):
        assert all(isinstance(k, str) for k in tree), f"non-string keys in {list(tree)}"
        return {k: _round_trip(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return [_round_trip(v) for v in tree]
    assert tree is None or isinstance(tree, (int, float, str, bool)), type(tree)
    return json.loads(json.dumps(tree))


def _draw() -> dict[str, Any]:
    x = torch.ones(64, 64)
    return {
        "python": [*(random.random() for _ in range(5)), random.gauss(0, 1)],
        "numpy": [*np.random.rand(5).tolist(), float(np.random.standard_normal())],
        "torch": torch.rand(5).tolist() + torch.randn(3).tolist(),
        "dropout": F.dropout(x, p=0.5, training=True),
    }


def _seed(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def test_round_trip_gives_identical_streams() -> None:
    _seed(1)
    random.gauss(0, 1)  # leave a cached gaussian in python and numpy
    np.random.standard_normal()
    state = _round_trip(RNG().state_dict())
    expected = _draw()
    _seed(2)  # disturb everything
    _draw()
    RNG().load_state_dict(state)
    got = _draw()
    assert got["python"] == expected["python"]
    assert got["numpy"] == expected["numpy"]
    assert got["torch"] == expected["torch"]
    assert torch.equal(got["dropout"], expected["dropout"])


def test_state_dict_shape_and_kinds() -> None:
    state = RNG().state_dict()
    assert set(state) >= {"python", "numpy", "torch"}
    assert len(state["python"]["state"]) == 625
    assert state["numpy"]["keys"].dtype == np.uint32
    assert state["numpy"]["keys"].shape == (624,)
    assert state["torch"].dtype == torch.uint8
    assert "cuda" not in state or isinstance(state["cuda"], list)


def test_state_is_a_snapshot_not_a_view() -> None:
    rng = RNG()
    state = rng.state_dict()
    keys_before = state["numpy"]["keys"].copy()
    torch_before = state["torch"].clone()
    np.random.rand(1000)
    torch.rand(1000)
    assert np.array_equal(state["numpy"]["keys"], keys_before)
    assert torch.equal(state["torch"], torch_before)


def test_disabled_parts_are_neither_saved_nor_restored() -> None:
    state = RNG(python=False, numpy=False, cuda=False).state_dict()
    assert set(state) == {"torch"}
    _seed(3)
    py_before = random.getstate()
    full = RNG().state_dict()
    random.random()
    RNG(python=False).load_state_dict(full)
    assert random.getstate() != py_before  # python left alone
    RNG().load_state_dict(full)
    assert random.getstate() == py_before


def test_missing_part_raises_and_changes_nothing() -> None:
    state = RNG(numpy=False).state_dict()
    before = torch.get_rng_state()
    torch.rand(3)
    after_draw = torch.get_rng_state()
    with pytest.raises(StateMismatchError, match="numpy"):
        RNG().load_state_dict(state)
    assert torch.equal(torch.get_rng_state(), after_draw)
    assert not torch.equal(after_draw, before)


@pytest.mark.parametrize(
    ("part", "bad"),
    [
        ("python", {"version": 3, "state": [1, 2], "gauss": None}),
        ("python", "nope"),
        (
            "numpy",
            {"keys": np.zeros(3, np.uint32), "pos": 0, "has_gauss": 0, "cached_gaussian": 0.0},
        ),
        ("torch", torch.zeros(5, dtype=torch.float32)),
        ("cuda", "not a list"),
    ],
)
def test_invalid_parts_raise(part: str, bad: Any) -> None:
    state = RNG().state_dict()
    state[part] = bad
    with pytest.raises(StateMismatchError, match=part):
        RNG().load_state_dict(state)


def test_not_a_dict_raises() -> None:
    with pytest.raises(StateMismatchError, match="must be a dict"):
        RNG().load_state_dict([1, 2])  # type: ignore[arg-type]


def test_cuda_states_for_missing_gpus_warn_and_restore_the_rest(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    restored: list[int] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(
        torch.cuda, "set_rng_state", lambda st, device: restored.append(int(device))
    )
    state = RNG().state_dict()
    state["cuda"] = [torch.zeros(16, dtype=torch.uint8), torch.ones(16, dtype=torch.uint8)]
    with caplog.at_level(logging.WARNING, logger="flashckpt.state.rng"):
        RNG().load_state_dict(state)
    assert restored == [0]
    assert "2 devices but this machine has 1" in caplog.text


def test_cuda_states_on_a_cpu_machine_warn(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    state = RNG().state_dict()
    state["cuda"] = [torch.zeros(16, dtype=torch.uint8)]
    with caplog.at_level(logging.WARNING, logger="flashckpt.state.rng"):
        RNG().load_state_dict(state)
    assert "this machine has 0" in caplog.text


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_round_trip() -> None:
    torch.cuda.init()
    torch.cuda.manual_seed_all(5)
    state = _round_trip(RNG().state_dict())
    assert len(state["cuda"]) == torch.cuda.device_count()
    x = torch.ones(256, 256, device="cuda")
    expected = (torch.rand(8, device="cuda"), F.dropout(x, p=0.5, training=True))
    torch.cuda.manual_seed_all(6)
    RNG().load_state_dict(state)
    got = (torch.rand(8, device="cuda"), F.dropout(x, p=0.5, training=True))
    assert torch.equal(got[0], expected[0])
    assert torch.equal(got[1], expected[1])
