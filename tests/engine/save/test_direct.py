"""Every byte moves once: an asynchronous save to a memory tier stages each CPU chunk straight
into the tier's chunk file (hashed on the way), so no persist worker writes it a second time and
no staging arena holds a copy of it."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
import torch

import flashckpt
from flashckpt.errors import FlashCkptError, SaveError
from flashckpt.store.files.backend import LocalBackend, StagedFile
from flashckpt.store.gc import collect_garbage
from flashckpt.store.store import STAGING_DIR, CheckpointStore

MiB = 1 << 20


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

    def counting_open(self, head, size=None):
        seen["staged"] += self.root == mem
        return open_staged(self, head, size)

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


def test_chunks_freed_by_retention_are_recycled_and_refilled_at_memory_speed(tmp_path, mem):
    """Retention frees old steps' chunk files; their resident pages take the next saves'
    chunks of the same size (no page is allocated again), and a clean close deletes the pool."""
    state = _state(n=4, numel=256 * 1024)  # 1 MiB tensors, one chunk each
    with flashckpt.Checkpointer(
        tmp_path / "root", async_save=True, memory_tier=mem, keep_memory=1
    ) as ck:
        inodes: dict[int, set[int]] = {}
        for step in range(1, 6):
            _bump(state)
            ck.save(step, state).durable.result()
            ck._saver.after.wait()  # retention and gc of the memory tier after this save
            inodes[step] = {p.stat().st_ino for p in (mem / "chunks").rglob("*") if p.is_file()}
        backend = ck._tiers.fastest.store.backend
        assert backend.recycle_bytes > 0
        reused = inodes[5] & set().union(*(inodes[s] for s in range(1, 4)))
        assert reused, "no recycled file was refilled"
        assert ck.steps()[-1] == 5
    assert not (mem / "staging" / "free").exists() or not list((mem / "staging" / "free").iterdir())
    fresh = _state(n=4, numel=256 * 1024)
    with flashckpt.Checkpointer(tmp_path / "root", memory_tier=mem) as ck:
        assert ck.restore(fresh) == 5
    for a, b in zip(state["model"], fresh["model"], strict=True):
        assert torch.equal(a, b)


def test_a_recycled_file_someone_still_has_open_is_never_overwritten(tmp_path, mem):
    """A reader that opened a chunk before gc moved it into the pool keeps its bytes: the
    write lease fails while it holds the file, and the writer takes a fresh file instead."""
    root = mem
    backend = LocalBackend(root)
    backend.recycle_bytes = 1 << 30
    payload = os.urandom(8192)
    backend.put("chunks/ab/abcd", [payload])
    reader = open(root / "chunks" / "ab" / "abcd", "rb")  # noqa: SIM115 - held open on purpose
    try:
        assert backend.recycle("chunks/ab/abcd") == 8192
        staged = backend.open_staged(STAGING_DIR, 8192)
        assert not staged.recycled  # the lease failed: a fresh file
        staged.write(b"x" * 8192)
        staged.publish("chunks/cd/cdef")
        assert reader.read() == payload
    finally:
        reader.close()
    # nobody holds the other pooled file now (the refused one was deleted)
    assert backend.recycle("chunks/cd/cdef") == 8192
    staged = backend.open_staged(STAGING_DIR, 8192)
    assert staged.recycled
    staged.write(b"y" * 8192)
    assert staged.publish("chunks/ef/ef01") == 8192
    assert (root / "chunks" / "ef" / "ef01").read_bytes() == b"y" * 8192


def test_a_planted_file_in_the_pool_is_never_filled(tmp_path, mem):
    """Only this user's regular files with one link are reused: a hard link planted in the
    pool (a file elsewhere that the writer would overwrite) is deleted, never written."""
    backend = LocalBackend(mem)
    backend.recycle_bytes = 1 << 30
    free = mem / "staging" / "free"
    free.mkdir(parents=True)
    victim = mem / "victim"
    victim.write_bytes(b"v" * 4096)
    os.link(victim, free / "4096-1-1.free")
    staged = backend.open_staged(STAGING_DIR, 4096)
    assert not staged.recycled
    staged.abort()
    assert victim.read_bytes() == b"v" * 4096


def test_a_chunk_copied_first_that_did_not_change_is_dropped_not_stored_twice(tmp_path, mem):
    """A chunk that changed last time is copied into a recycled file before it is hashed; when
    its hash shows the tier holds those bytes already, the copy is dropped (nothing new is
    stored), the next save hashes it first again, and restore is bitwise."""
    state = _state(n=4, numel=256 * 1024)
    with flashckpt.Checkpointer(
        tmp_path / "root", async_save=True, memory_tier=mem, keep_memory=1
    ) as ck:
        for step in range(1, 5):  # changes every time: hints say "changed", the pool fills
            _bump(state)
            ck.save(step, state).durable.result()
            ck._saver.after.wait()
        assert all(ck._saver.hints.values())
        stats = ck.save(5, state).durable.result()  # unchanged since step 4
        assert stats.new_bytes == 0 and stats.chunks_reused == len(state["model"])
        assert not any(ck._saver.hints.values())  # hashed first next time
        assert list((mem / STAGING_DIR).glob("*.tmp-*")) == []
    fresh = _state(n=4, numel=256 * 1024)
    with flashckpt.Checkpointer(tmp_path / "root", memory_tier=mem) as ck:
        assert ck.restore(fresh) == 5
    for a, b in zip(state["model"], fresh["model"], strict=True):
        assert torch.equal(a, b)


def _restores_to(tmp_path: Path, mem: Path, state: dict, step: int, numel: int) -> None:
    """A fresh Checkpointer on the root restores ``step``, equal to ``state`` bit for bit."""
    fresh = _state(n=len(state["model"]), numel=numel)
    with flashckpt.Checkpointer(tmp_path / "root", memory_tier=mem) as ck:
        assert ck.restore(fresh) == step
    for a, b in zip(state["model"], fresh["model"], strict=True):
        assert torch.equal(a, b)


def _recycling(tmp_path: Path, mem: Path, monkeypatch, helpers: int = 2):
    """A memory-tier Checkpointer whose saves recycle the files retention frees, with
    ``helpers`` copy threads."""
    from flashckpt.engine.runtime import saving

    monkeypatch.setattr(saving, "copy_helpers", lambda: helpers)
    return flashckpt.Checkpointer(
        tmp_path / "root", async_save=True, memory_tier=mem, keep_memory=1, fsync=False
    )


def test_a_recycled_file_is_filled_on_every_core_while_the_save_is_waited_for(
    tmp_path, mem, monkeypatch
):
    """A save the loop waits for (here: a state without an optimizer, staged before save()
    returns) fills its recycled chunk files with the copy split across the helper threads,
    and the tier's copy restores bit for bit."""
    from flashckpt.engine.save.copier import Copier

    parts: list[int] = []
    real = Copier.copy

    def copy(self, buf, views):
        parts.append(real(self, buf, views))
        return parts[-1]

    monkeypatch.setattr(Copier, "copy", copy)
    state = _state(n=4, numel=512 * 1024)  # 2 MiB tensors, one chunk each
    with _recycling(tmp_path, mem, monkeypatch) as ck:
        for step in range(1, 5):
            _bump(state)
            ck.save(step, state).durable.result()
            assert ck.wait_promoted(30)
            ck._saver.after.wait()  # retention frees the older step's files for the next
    assert parts and max(parts) == 3, parts  # recycled files, filled by three threads
    _restores_to(tmp_path, mem, state, 4, numel=512 * 1024)


def test_a_failed_fill_of_a_recycled_file_commits_nothing_and_keeps_older_steps(
    tmp_path, mem, monkeypatch
):
    from flashckpt.engine.save.copier import Copier

    state = _state(n=4, numel=512 * 1024)
    with _recycling(tmp_path, mem, monkeypatch) as ck:
        for step in (1, 2, 3):
            _bump(state)
            ck.save(step, state).durable.result()
            assert ck.wait_promoted(30)
            ck._saver.after.wait()  # retention frees the older step's files for the next
        real = Copier.copy

        def failing(self, buf, views):
            raise OSError(errno.EIO, "Input/output error (injected into a part)")

        monkeypatch.setattr(Copier, "copy", failing)
        _bump(state)
        with pytest.raises(FlashCkptError, match="injected into a part"):
            ck.save(4, state).durable.result()
        monkeypatch.setattr(Copier, "copy", real)
        assert ck.steps()[-1] == 3  # step 4 committed nowhere, the older ones kept
        _bump(state)
        ck.save(5, state).durable.result()
        assert ck.steps()[-1] == 5
    assert list((mem / STAGING_DIR).glob("*.tmp-*")) == []
    _restores_to(tmp_path, mem, state, 5, numel=512 * 1024)
