"""The device-staging path (side stream, event, device fingerprints, copies into the pool) run
on CPU through the asynchronous stand-in for the CUDA calls (fake_device.py, installed as
flashckpt.engine.device.OPS), so its logic is tested without a GPU. Every CPU tensor is treated
as a cuda:0 tensor here."""

from __future__ import annotations

import errno
from collections.abc import Iterator

import pytest
import torch
from fake_device import FakeDevice

import flashckpt
from flashckpt.engine.save.staging import StagingPool
from flashckpt.store.store import CheckpointStore

CHUNK = "64KiB"


@pytest.fixture
def cuda(monkeypatch) -> Iterator[FakeDevice]:
    """Every CPU tensor counts as a cuda:0 tensor (no pinned memory on this host)."""
    fake = FakeDevice(delay_s=0.0, default_device="cuda:0", pinnable=False).install(monkeypatch)
    yield fake
    fake.close()


@pytest.fixture
def staged(monkeypatch) -> dict:
    """Counts chunks copied device -> host (each takes a staging range)."""
    count = {"n": 0}
    real = StagingPool.try_acquire

    def counting(self, nbytes):
        count["n"] += 1
        return real(self, nbytes)

    monkeypatch.setattr(StagingPool, "try_acquire", counting)
    return count


def _weights(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(4 * 16384, generator=g), "b": torch.randn(64, generator=g)}


def _restored(root, step) -> dict:
    out = {"w": torch.empty(4 * 16384), "b": torch.empty(64)}
    assert flashckpt.restore(root, {"p": out}, step=step) == step
    return out


def test_device_path_uses_a_side_stream_after_the_training_event(tmp_path, cuda, staged):
    w = _weights()
    cuda.launch(lambda: w["w"].add_(1.0), "cuda:0", delay_s=0.2)  # the step, still queued
    expect = {k: v.clone() for k, v in w.items()}
    expect["w"] += 1.0
    with flashckpt.Checkpointer(tmp_path, chunk_size=CHUNK) as ck:
        ck.save(1, {"p": w})
    assert cuda.streams_created == {0: 1}  # one side stream, on the tensors' device
    assert staged["n"] == 5  # four w chunks + one b pack
    got = _restored(tmp_path, 1)
    assert torch.equal(got["w"], expect["w"]) and torch.equal(got["b"], expect["b"])


def test_unchanged_chunks_are_not_copied_and_a_flipped_bit_is(tmp_path, cuda, staged):
    w = _weights()
    with flashckpt.Checkpointer(tmp_path, chunk_size=CHUNK) as ck:
        ck.save(1, {"p": w})
        staged["n"] = 0
        ck.save(2, {"p": w})
        assert staged["n"] == 0  # every fingerprint unchanged: nothing left the device
        w["w"].view(torch.int32)[20000] ^= 1 << 7  # one bit in the second chunk
        ck.save(3, {"p": w})
        assert staged["n"] == 1
    got = _restored(tmp_path, 3)
    assert torch.equal(got["w"].view(torch.int32), w["w"].view(torch.int32))


def test_chunk_the_store_lost_is_written_again_though_its_fingerprint_is_unchanged(tmp_path, cuda):
    """The fingerprint says "unchanged" but the chunk is gone from the store (a failed save,
    gc, quarantine): it used to be claimed, never written, and referenced by the manifest."""
    w = _weights()
    with flashckpt.Checkpointer(tmp_path, chunk_size=CHUNK) as ck:
        ck.save(1, {"p": w})
        for f in (tmp_path / "chunks").rglob("*"):
            if f.is_file():
                f.unlink()
        ck.save(2, {"p": w})
    got = _restored(tmp_path, 2)
    assert torch.equal(got["w"], w["w"]) and torch.equal(got["b"], w["b"])


def test_fingerprints_of_a_failed_save_are_not_trusted_by_the_next(tmp_path, cuda, monkeypatch):
    """Save 2 changes a chunk and fails on a full disk; save 3 of the same bytes must write
    that chunk. Recording the fingerprint before the commit made save 3 reuse a chunk that
    was never written (every later manifest referenced it while the tensor stayed frozen)."""
    w = _weights()
    real = CheckpointStore.put_chunk
    full = {"on": False}

    def put_chunk(self, *a, **kw):
        if full["on"]:
            raise OSError(errno.ENOSPC, "No space left on device (injected)")
        return real(self, *a, **kw)

    monkeypatch.setattr(CheckpointStore, "put_chunk", put_chunk)
    with flashckpt.Checkpointer(tmp_path, chunk_size=CHUNK) as ck:
        ck.save(1, {"p": w})
        w["w"][:100] += 1.0
        full["on"] = True
        with pytest.raises(flashckpt.SaveError):
            ck.save(2, {"p": w})
        full["on"] = False
        ck.save(3, {"p": w})  # the same bytes as the failed save 2
    got = _restored(tmp_path, 3)
    assert torch.equal(got["w"], w["w"])
