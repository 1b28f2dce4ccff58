"""Synchronous saves: hashed and written from the live tensors by the persist workers, chunk
directories fsynced together, the manifest last (benchmarks/save_bench.py --sync-vs-torch)."""

from __future__ import annotations

import threading

import pytest
import torch

import flashckpt
from flashckpt.engine.save import job as save_mod
from flashckpt.engine.save.warmup import SYNC_IO_THREADS, persist_threads
from flashckpt.store.files.backend import LocalBackend
from flashckpt.store.format import codec as codecs

MiB = 1 << 20


def _state(n: int = 12, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    state = {f"w{i}": torch.randn(64 * 1024, generator=g) for i in range(n)}  # 256 KiB each
    state["small"] = {f"b{i}": torch.randn(7, generator=g) for i in range(30)}
    state["half"] = torch.randn(5000, generator=g).half()
    state["meta"] = {"step": 3, "name": "x"}
    return state


def _roundtrip(root, state: dict, step: int) -> None:
    out = {
        k: (torch.zeros_like(v) if isinstance(v, torch.Tensor) else None) for k, v in state.items()
    }
    with flashckpt.Checkpointer(root) as ck:
        assert ck.restore(out, step=step) == step
    for k, v in state.items():
        if isinstance(v, torch.Tensor):
            assert out[k].dtype == v.dtype and torch.equal(out[k], v), k
    if "meta" in state:
        assert out["meta"] == state["meta"]
        assert all(torch.equal(out["small"][k], v) for k, v in state["small"].items())


class RecordingBackend(LocalBackend):
    """Records, in order, which thread synced which directories and when the manifest landed."""

    def __init__(self, root) -> None:
        super().__init__(root)
        self.events: list[tuple[str, object, bool]] = []
        self._lock = threading.Lock()

    def sync_dirs(self, dirs):
        with self._lock:
            self.events.append(("sync", tuple(dirs), _on_main()))
        super().sync_dirs(dirs)

    def put(self, path, parts):
        n = super().put(path, parts)
        if path.startswith("steps/"):
            with self._lock:
                self.events.append(("manifest", path, _on_main()))
        return n


def _on_main() -> bool:
    return threading.current_thread() is threading.main_thread()


def test_sync_save_hashes_in_the_workers_not_on_the_callers_thread(tmp_path, monkeypatch):
    """Regression: a synchronous save hashed every chunk on the training thread, one after
    another, ahead of the writes (xxh3 of 2 GiB is ~1 s on one core). Now the persist workers
    hash and write straight from the live tensors; the bytes round-trip bitwise."""
    threads: list[bool] = []
    real = codecs.hash_parts

    def spy(parts):
        threads.append(_on_main())
        return real(parts)

    monkeypatch.setattr(save_mod.codecs, "hash_parts", spy)
    state = _state()
    with flashckpt.Checkpointer(tmp_path, chunk_size="256KiB") as ck:
        stats = ck.save(1, state).durable.result(timeout=60)
    assert threads and not any(threads), "a chunk was hashed on the caller's thread"
    assert stats.chunks_new >= 12
    _roundtrip(tmp_path, state, 1)


def test_sync_save_fsyncs_chunk_dirs_in_the_workers_before_the_manifest(tmp_path):
    """Regression: the commit fsynced each chunk directory in turn on the caller's thread (99
    directories for a 123 MiB state: 0.4-1.3 s, more than torch.save's whole save). Now the
    worker that wrote a chunk fsyncs its directory right after the rename, and every chunk
    directory is durable before the manifest is written."""
    state = _state(n=40)
    with flashckpt.Checkpointer(tmp_path, chunk_size="256KiB") as ck:
        backend = RecordingBackend(tmp_path)
        ck.store.backend = backend
        ck.save(1, state)
    events = backend.events
    manifest_at = next(i for i, e in enumerate(events) if e[0] == "manifest")
    chunk_syncs = [e for e in events[:manifest_at] if e[0] == "sync" and e[1]]
    synced = {d for e in chunk_syncs for d in e[1] if d.startswith("chunks/")}
    assert not any(e[2] for e in chunk_syncs), "chunk directories fsynced on the caller"
    wrote = {p.parent.name for p in (tmp_path / "chunks").rglob("*") if p.is_file()}
    assert len(wrote) >= 10 and {d.split("/")[1] for d in synced} == wrote
    after = [e for e in events[manifest_at:] if e[0] == "sync"]
    assert after == [("sync", ("steps",), True)], "only steps/ is synced after the manifest"
    _roundtrip(tmp_path, state, 1)


def test_sync_save_with_duplicate_and_unchanged_chunks_writes_each_once(tmp_path):
    """Hashing moved into the workers: reuse decisions still hold when they race (the same
    bytes twice in one save are written once; an unchanged re-save writes nothing)."""
    same = torch.randn(64 * 1024)
    state = {"a": same.clone(), "b": same.clone(), "c": torch.randn(64 * 1024)}
    with flashckpt.Checkpointer(tmp_path, chunk_size="256KiB") as ck:
        first = ck.save(1, state).durable.result(timeout=60)
        second = ck.save(2, state).durable.result(timeout=60)
    assert first.chunks_new == 2 and first.reused_bytes == 256 * 1024
    assert second.chunks_new == 0 and second.new_bytes == 0
    assert len([p for p in (tmp_path / "chunks").rglob("*") if p.is_file()]) == 2
    _roundtrip(tmp_path, state, 2)


def test_failed_chunk_write_in_a_sync_save_commits_nothing(tmp_path):
    class Failing(LocalBackend):
        def put(self, path, parts):
            if path.startswith("chunks/") and torch.rand(()) < 0.5:
                raise OSError(5, "Input/output error (injected)")
            return super().put(path, parts)

    state = _state(n=20)
    with flashckpt.Checkpointer(tmp_path, chunk_size="256KiB") as ck:
        ck.save(1, state)
        ck.store.backend = Failing(tmp_path)
        torch.manual_seed(0)
        with pytest.raises(flashckpt.SaveError, match="injected"):
            ck.save(2, _state(n=20, seed=1))
        assert ck.steps() == [1]
    _roundtrip(tmp_path, state, 1)


def test_sync_checkpointers_get_io_threads_async_ones_keep_the_cpu_count():
    assert persist_threads(workers=4, persist_workers=0, async_save=False) == SYNC_IO_THREADS
    assert persist_threads(workers=4, persist_workers=0, async_save=True) == 4
    assert persist_threads(workers=3, persist_workers=3, async_save=False) == 3  # as asked


def test_sync_save_of_many_chunks_uses_the_io_threads(tmp_path, monkeypatch):
    names: set[str] = set()
    real = LocalBackend.put

    def spy(self, path, parts):
        names.add(threading.current_thread().name)
        return real(self, path, parts)

    monkeypatch.setattr(LocalBackend, "put", spy)
    state = {f"w{i}": torch.randn(16 * 1024) for i in range(64)}  # 64 chunks of 64 KiB
    with flashckpt.Checkpointer(tmp_path, chunk_size="64KiB") as ck:
        assert ck._workers._max_workers == SYNC_IO_THREADS
        ck.save(1, state)
    assert len({n for n in names if n.startswith("flashckpt-persist")}) > 4


def test_failed_chunk_directory_fsync_commits_nothing_and_cleans_up(tmp_path):
    """The worker fsyncs a chunk's directory after writing it; when that fsync fails the save
    fails, nothing is committed, step 1 stays whole and the chunks written are collected.
    Regression: the chunk was recorded as written only after the fsync, so this cleanup saw
    nothing written and left the chunks behind."""

    class DirSyncFails(LocalBackend):
        def sync_dirs(self, dirs):
            if any(d.startswith("chunks/") for d in dirs):
                raise flashckpt.errors.StorageError("directory fsync failed (injected)")
            super().sync_dirs(dirs)

    state = _state(n=6)
    with flashckpt.Checkpointer(tmp_path, chunk_size="256KiB") as ck:
        ck.save(1, state)
        before = {p.name for p in (tmp_path / "chunks").rglob("*") if p.is_file()}
        ck.store.backend = DirSyncFails(tmp_path)
        with pytest.raises(flashckpt.errors.StorageError, match="injected"):
            ck.save(2, _state(n=6, seed=1))
        assert ck.steps() == [1]
    after = {p.name for p in (tmp_path / "chunks").rglob("*") if p.is_file()}
    assert after == before, "chunks of the failed save were left behind"
    _roundtrip(tmp_path, state, 1)


def test_sync_save_leaves_retention_to_the_staging_thread(tmp_path, monkeypatch):
    """Regression: a synchronous save deleted the older checkpoints' chunks on the caller's
    thread before returning (0.2 s of a 0.6 s save of a 123 MiB state on ext4: the unlinks).
    Now the save returns once durable; retention follows on the staging thread, and the next
    save, steps(), wait() and close() see it done."""
    from flashckpt.engine.tiers.tierset import TierSet

    where: list[str] = []
    real = TierSet.retain

    def spy(self, tier):
        where.append(threading.current_thread().name)
        return real(self, tier)

    monkeypatch.setattr(TierSet, "retain", spy)
    with flashckpt.Checkpointer(tmp_path, keep=2, chunk_size="256KiB") as ck:
        for step in range(1, 5):
            ck.save(step, _state(n=4, seed=step))
        assert ck.steps() == [3, 4]
    assert len(where) == 4 and all(n.startswith("flashckpt-stage") for n in where), where
    files = {p.name for p in (tmp_path / "chunks").rglob("*") if p.is_file()}
    assert len(files) == 2 * (4 + 1)  # steps 3 and 4: 4 big chunks + 1 of the small ones each
    _roundtrip(tmp_path, _state(n=4, seed=4), 4)


def test_failed_retention_after_a_sync_save_is_logged_and_the_save_stands(
    tmp_path, monkeypatch, caplog
):
    from flashckpt.engine.tiers.tierset import TierSet

    def broken(self, tier):
        raise flashckpt.errors.StorageError("listing steps/ failed (injected)")

    monkeypatch.setattr(TierSet, "retain", broken)
    with flashckpt.Checkpointer(tmp_path, keep=1) as ck:
        ck.save(1, _state(n=2))
        ck.save(2, _state(n=2, seed=2))
        ck.wait()
        assert ck.steps() == [1, 2]  # nothing deleted, nothing lost
    assert "retention after step 2 failed" in caplog.text and "injected" in caplog.text
    _roundtrip(tmp_path, _state(n=2, seed=2), 2)


def test_manifest_drafted_during_the_writes_equals_the_one_built_after(tmp_path):
    """The tensor entries and their JSON are made while the workers write (engine/save/manifests.py
    ``draft``), assuming chunk i is stored chunk i; the manifest on disk is the same as one
    built from scratch after the writes, with distinct chunks and with duplicates (where the
    draft does not hold and is not used)."""
    from flashckpt.engine.save.manifests import job_manifest
    from flashckpt.store.format.parse import parse_manifest

    seen: list = []
    real = save_mod.SaveJob.build_manifest

    def spy(self):
        m = real(self)
        again = job_manifest(
            step=self.handle.step, hashes=self.hashes, refs=self.ledger.refs, chunks=self.chunks,
            captured=self.captured, ctx=self.ctx, stats=m.stats,
        )  # fmt: skip
        again.time_s = m.time_s
        seen.append((self._draft is not None, len(set(self.hashes)) < len(self.hashes)))
        assert json_of(m) == json_of(again)
        return m

    def json_of(m):
        import json

        return json.loads(m.to_json())

    same = torch.randn(64 * 1024)
    with flashckpt.Checkpointer(tmp_path, chunk_size="256KiB") as ck:
        save_mod.SaveJob.build_manifest = spy
        try:
            ck.save(1, _state())
            ck.save(2, {"a": same.clone(), "b": same.clone(), "c": torch.randn(64 * 1024)})
        finally:
            save_mod.SaveJob.build_manifest = real
        on_disk = parse_manifest(ck.store.backend.read("steps/000000000001.json"))
    assert seen == [(True, False), (True, True)]
    assert on_disk.tensors == ck.store.load_manifest(1).tensors and len(on_disk.tensors) == 43
    _roundtrip(tmp_path, _state(), 1)
