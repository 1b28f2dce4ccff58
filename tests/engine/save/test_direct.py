"""Every byte moves once: an asynchronous save to a memory tier stages each CPU chunk straight
into the tier's chunk file (hashed on the way), so no persist worker writes it a second time and
no staging arena holds a copy of it."""

from __future__ import annotations

import errno
import os
import uuid
from pathlib import Path

import pytest
import torch

import flashckpt
from flashckpt.errors import FlashCkptError, SaveError
from flashckpt.store.files.backend import LocalBackend, StagedFile
from flashckpt.store.gc import collect_garbage
from flashckpt.store.store import STAGING_DIR, CheckpointStore

MiB = 1 << 20


@pytest.fixture
def mem(tmp_path: Path):
    """A memory tier directory in /dev/shm (tmpfs), removed afterwards."""
    import shutil

    path = Path("/dev/shm") / f"fc-direct-{uuid.uuid4().hex[:10]}"
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _state(n: int = 6, numel: int = 300_000) -> dict:
    torch.manual_seed(0)
    params = torch.nn.ParameterList(torch.nn.Parameter(torch.randn(numel)) for _ in range(n))
    return {"model": params}


def _bump(state: dict, which: int | None = None) -> None:
    with torch.no_grad():
        for i, p in enumerate(state["model"]):
            if which is None or i == which:
                p.add_(1)


def _count(monkeypatch, mem: Path) -> dict[str, int]:
    """Count chunk writes into the memory tier ``mem`` through put() and through staged files
    (promotion's writes to the disk tier are not counted)."""
    seen = {"put_chunks": 0, "staged": 0}
    put, open_staged = LocalBackend.put, LocalBackend.open_staged

    def counting_put(self, path, parts):
        if path.startswith("chunks/") and self.root == mem:
            seen["put_chunks"] += 1
        return put(self, path, parts)

    def counting_open(self, head):
        seen["staged"] += self.root == mem
        return open_staged(self, head)

    monkeypatch.setattr(LocalBackend, "put", counting_put)
    monkeypatch.setattr(LocalBackend, "open_staged", counting_open)
    return seen


def test_memory_tier_chunks_are_written_once_by_staging_and_restore_bitwise(
    tmp_path, mem, monkeypatch
):
    state = _state()
    seen = _count(monkeypatch, mem)
    promotion = flashckpt.Promotion(every=1000)  # nothing reaches disk: only the memory tier
    with flashckpt.Checkpointer(
        tmp_path / "root", async_save=True, memory_tier=mem, promotion=promotion
    ) as ck:
        ck.save(1, state).durable.result()
        assert seen["put_chunks"] == 0, "a persist worker wrote a staged chunk again"
        assert seen["staged"] >= 1
        assert ck._saver.pool.capacity_bytes == 0, "a staging arena was reserved for CPU bytes"
    assert list((mem / STAGING_DIR).glob("*.tmp-*")) == []
    fresh = _state()
    _bump(fresh)  # different from the saved state
    with flashckpt.Checkpointer(tmp_path / "root", memory_tier=mem, promotion=promotion) as ck:
        assert ck.restore(fresh) == 1
    for a, b in zip(state["model"], fresh["model"], strict=True):
        assert torch.equal(a, b)


def test_an_unchanged_chunk_is_hashed_first_and_never_written_again(tmp_path, mem, monkeypatch):
    state = _state()
    with flashckpt.Checkpointer(tmp_path / "root", async_save=True, memory_tier=mem) as ck:
        ck.save(1, state).durable.result()
        ck.save(2, state).durable.result()  # learns which chunks did not change
        seen = _count(monkeypatch, mem)
        _bump(state, which=0)  # one tensor changes
        h = ck.save(3, state)
        stats = h.durable.result()
        assert stats.new_bytes > 0 and stats.reused_bytes > stats.new_bytes
        assert seen["staged"] == stats.chunks_new, (seen, stats)
        assert seen["put_chunks"] == 0


def test_a_failed_staged_write_commits_nothing_leaves_no_temp_and_keeps_older_steps(
    tmp_path, mem, monkeypatch
):
    state = _state()
    with flashckpt.Checkpointer(tmp_path / "root", async_save=True, memory_tier=mem) as ck:
        ck.save(1, state).durable.result()
        _bump(state)
        real = StagedFile.write
        calls = {"n": 0}

        def full_disk(self, buf):
            calls["n"] += 1
            if calls["n"] > 2:
                self.abort()
                raise OSError(errno.ENOSPC, "No space left on device (injected)")
            return real(self, buf)

        monkeypatch.setattr(StagedFile, "write", full_disk)
        h = ck.save(2, state)
        with pytest.raises(SaveError, match="No space left"):
            h.durable.result()
        monkeypatch.setattr(StagedFile, "write", real)
        assert ck.steps() == [1]
        ck.save(3, state).durable.result()
        assert ck.steps() == [1, 3]
    assert list((mem / STAGING_DIR).glob("*.tmp-*")) == []
    fresh = _state()
    with flashckpt.Checkpointer(tmp_path / "root", memory_tier=mem) as ck:
        assert ck.restore(fresh, step=1) == 1


def test_gc_sweeps_the_staged_file_of_a_dead_writer_and_keeps_a_live_ones(tmp_path):
    root = tmp_path / "tier"
    store = CheckpointStore(LocalBackend(root))
    (root / STAGING_DIR).mkdir(parents=True)
    dead = root / STAGING_DIR / "staged.tmp-999999999-0"  # no such pid
    alive = root / STAGING_DIR / f"staged.tmp-{os.getpid()}-7"
    dead.write_bytes(b"x" * 10)
    alive.write_bytes(b"y" * 10)
    res = collect_garbage(store, full=True)
    assert res.temp_deleted == 1
    assert not dead.exists() and alive.exists()


def test_a_staging_directory_that_is_a_symlink_is_never_written_through(tmp_path, mem):
    outside = tmp_path / "outside"
    outside.mkdir()
    state = _state(n=2, numel=1000)
    with flashckpt.Checkpointer(tmp_path / "root", async_save=True, memory_tier=mem) as ck:
        ck.save(1, state).durable.result()
        staging = mem / STAGING_DIR
        if staging.exists():
            for p in staging.iterdir():
                p.unlink()
            staging.rmdir()
        staging.symlink_to(outside)
        _bump(state)
        h = ck.save(2, state)
        with pytest.raises(FlashCkptError, match="symlink"):
            h.durable.result()
        assert ck.steps() == [1]
    assert list(outside.iterdir()) == []
