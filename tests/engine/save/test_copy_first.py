"""An asynchronous save to disk stages a chunk expected to change in one pass: copied into the
arena at once and hashed from the copy by a persist worker (engine/save/job.py ``_stage_cpu``).
Only a chunk that was unchanged at the previous save is hashed first on the staging thread, so
an unchanged chunk is still never copied. Regression: every chunk was hashed on the staging
thread and then copied, two passes over the bytes inside the blocking part of every save (the
cold first save blocked 1.3-2.5x ``dcp.async_save``'s)."""

from __future__ import annotations

import threading
from collections import Counter

import pytest
import torch

import flashckpt
from flashckpt.store.format import codec as codecs


@pytest.fixture
def hashed_on(monkeypatch):
    """Counts hash_parts calls per thread kind ("stage", "persist", other)."""
    seen: Counter[str] = Counter()
    real = codecs.hash_parts

    def spy(parts):
        name = threading.current_thread().name
        seen["stage" if "stage" in name else "persist" if "persist" in name else "other"] += 1
        return real(parts)

    monkeypatch.setattr(codecs, "hash_parts", spy)
    return seen


def _state() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {f"w{i}": torch.randn(64 << 10) for i in range(4)}  # 256 KiB each: one chunk each


def test_changed_chunks_are_copied_first_and_unchanged_ones_hashed_first(tmp_path, hashed_on):
    state = _state()
    with flashckpt.Checkpointer(tmp_path, async_save=True, chunk_size="256KiB") as ck:
        first = ck.save(1, {"m": state}).wait()
        assert hashed_on["stage"] == 0, "a first save hashes nothing on the staging thread"
        assert hashed_on["persist"] == 4 and first.new_bytes == first.total_bytes

        hashed_on.clear()  # the same bytes again: copied (it changed last time), then found
        second = ck.save(2, {"m": state}).wait()
        assert hashed_on == {"persist": 4}
        assert second.new_bytes == 0 and second.chunks_reused == 4

        hashed_on.clear()  # unchanged last time: hashed first, one chunk changed since
        state["w2"].add_(1)
        third = ck.save(3, {"m": state}).wait()
        assert hashed_on == {"stage": 4}, "unchanged chunks are hashed where they lie"
        assert third.chunks_new == 1 and third.chunks_reused == 3

        hashed_on.clear()  # w2 changed last time: copied first; the rest hashed first
        fourth = ck.save(4, {"m": state}).wait()
        assert hashed_on == {"stage": 3, "persist": 1}
        assert fourth.chunks_new == 0
    with flashckpt.Checkpointer(tmp_path) as ck:
        for step in (1, 2, 3, 4):
            got = {"m": {k: torch.zeros_like(v) for k, v in state.items()}}
            assert ck.restore(got, step=step) == step
        assert all(torch.equal(got["m"][k], state[k]) for k in state)


def test_a_copy_first_chunk_holds_the_bytes_of_the_save_call(tmp_path):
    """The copy is what is hashed and written: training that changes the tensor right after
    the save was staged does not reach the checkpoint."""
    state = _state()
    want = {k: v.clone() for k, v in state.items()}
    with flashckpt.Checkpointer(tmp_path, async_save=True, chunk_size="256KiB") as ck:
        handle = ck.save(1, {"m": state})
        handle.staged.result()
        for v in state.values():
            v.mul_(-1)
        handle.wait()
        got = {"m": {k: torch.zeros_like(v) for k, v in state.items()}}
        assert ck.restore(got) == 1
    assert all(torch.equal(got["m"][k], want[k]) for k in want)
