"""A save's chunk decisions go through its liveness window (engine/save/ledger.py).

``SaveJob._reuse`` records the hash and asks the ledger."""

from __future__ import annotations

from types import SimpleNamespace

from flashckpt.engine.save.handle import SaveHandle, SaveStats
from flashckpt.engine.save.job import SaveJob
from flashckpt.store.files.backend import LocalBackend
from flashckpt.store.pins import PIN_DIR
from flashckpt.store.store import CheckpointStore


def _job(tmp_path, *, incremental=True) -> SaveJob:
    store = CheckpointStore(LocalBackend(tmp_path))
    ctx = SimpleNamespace(store=store, incremental=incremental)
    handle = SaveHandle(step=1, stats=SaveStats(step=1))
    return SaveJob(ctx=ctx, handle=handle, captured=None, chunks=[None, None], committer=None)


def test_chunk_claimed_by_a_fingerprint_attempt_is_still_written(tmp_path):
    """CUDA path: when the device fingerprint was unchanged but the store lacked the chunk, the
    chunk was claimed, never written, and named by every later manifest."""
    job = _job(tmp_path)
    h = "c" * 32
    assert job._reuse(0, h, 10) is False  # fingerprint says unchanged, the store lacks it
    assert job._reuse(0, h, 10) is False  # after hashing the staged bytes: must be written
    assert job._reuse(1, h, 10) is True  # the same bytes later in the save: written once
    assert job.handle.stats.chunks_new == 1 and job.handle.stats.total_bytes == 20
    job.release_pins(failed=True)


def test_a_save_pins_every_chunk_on_disk_until_it_ends(tmp_path):
    job = _job(tmp_path)
    store = job.ctx.store
    h = "a" * 32
    ref = store.put_chunk(h, 3, [b"abc"], "raw")
    assert ref.size == 3
    assert job._reuse(0, h, 3) is True  # present with the right size: reused
    assert store.liveness.pinned() == {h}
    assert len(list((tmp_path / PIN_DIR).glob("*.json"))) == 1
    job.release_pins()
    assert store.liveness.pinned() == set()
    assert list((tmp_path / PIN_DIR).glob("*.json")) == []


def test_a_wrong_size_chunk_is_not_reused(tmp_path):
    job = _job(tmp_path)
    store = job.ctx.store
    h = "b" * 32
    store.put_chunk(h, 3, [b"abc"], "raw")
    assert job._reuse(0, h, 4) is False  # the tier's file has 3 bytes, the chunk needs 4
    job.release_pins(failed=True)
