"""A chunk packed with many small tensors is hashed, copied and written as one array
(engine/save/layout.py joined), on every save path; larger pieces are handed on as they are."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import flashckpt
from flashckpt.engine.save.layout import SMALL_PIECE_BYTES, joined


def test_many_small_pieces_become_one_array() -> None:
    views = [np.full(n, n % 251, dtype=np.uint8) for n in (0, 1, 64, 7, 0, 300)]
    out = joined(views, sum(v.size for v in views))
    assert len(out) == 1
    assert np.array_equal(out[0], np.concatenate(views))


def test_large_pieces_are_left_alone() -> None:
    views = [np.zeros(SMALL_PIECE_BYTES * 2, dtype=np.uint8), np.ones(10, dtype=np.uint8)]
    out = joined(views, sum(v.size for v in views))
    assert len(out) == 2 and all(a is b for a, b in zip(out, views))
    one = [np.ones(5, dtype=np.uint8)]
    assert joined(one, 5) is one


def _state() -> dict:
    g = torch.Generator().manual_seed(3)
    sd: dict = {f"b{i}": torch.randn(i % 9, generator=g) for i in range(300)}  # empty ones too
    sd["half"] = torch.randn(33, generator=g).half()
    sd["ints"] = torch.arange(12, dtype=torch.int64).reshape(3, 4).t()  # not contiguous
    sd["mid"] = torch.randn(3000, generator=g)  # 12 KB: packed, not small
    return {"m": sd, "big": torch.randn(300_000, generator=g)}  # its own chunks


@pytest.mark.parametrize("mode", ["sync", "async-pool", "async-memory-tier"])
@pytest.mark.parametrize("incremental", [False, True])
def test_packs_round_trip(tmp_path, mode: str, incremental: bool) -> None:
    state = _state()
    kw: dict = {"incremental": incremental}
    if mode != "sync":
        kw["async_save"] = True
    if mode == "async-memory-tier":
        kw["memory_tier"] = tmp_path / "mem"
    with flashckpt.Checkpointer(tmp_path / "ck", **kw) as ck:
        ck.save(1, state).wait()
        state["m"]["b5"].add_(1)  # the second save: one small tensor changed
        ck.save(2, state).wait()
        out = {"m": {k: torch.zeros_like(v) for k, v in state["m"].items()}}
        out["big"] = torch.zeros_like(state["big"])
        assert ck.restore(out, step=2) == 2
    assert torch.equal(out["big"], state["big"])
    for k, v in state["m"].items():
        assert torch.equal(out["m"][k], v), k
