"""The liveness owner: fail-closed gc, verified reuse, quarantine, pins on disk, no false damage.

Each test named after a bug of issue 12 fails on the code before the liveness module.
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import flashckpt
from flashckpt.errors import LockedError, StorageError
from flashckpt.policy import KeepLast
from flashckpt.store import gc as gc_mod
from flashckpt.store import lock as lock_mod
from flashckpt.store.files.backend import LocalBackend
from flashckpt.store.format import parse as manifest_mod
from flashckpt.store.gc import collect_garbage
from flashckpt.store.lock import RootLock, WriterLock
from flashckpt.store.pins import PIN_DIR, new_record, write_pin
from flashckpt.store.store import CheckpointStore, step_name
from flashckpt.store.verify import verify_step


def _chunks(root: Path) -> set[str]:
    return {p.name for p in (root / "chunks").rglob("*") if p.is_file() and ".tmp-" not in p.name}


def _save(root: Path, values: dict[int, float], **kw) -> None:
    with flashckpt.Checkpointer(root, **kw) as ckpt:
        for step, v in values.items():
            ckpt.save(step, {"w": torch.full((4096,), v)})


def _restore(root: Path, step: int) -> torch.Tensor:
    out = {"w": torch.zeros(4096)}
    with flashckpt.Checkpointer(root) as ckpt:
        ckpt.restore(out, step=step)
    return out["w"]


def _chunk_files_of(root: Path, step: int) -> list[Path]:
    m = json.loads((root / step_name(step)).read_text())
    return [root / "chunks" / c[0][:2] / c[0] for c in m["chunks"]]


# -- gc fails closed --------------------------------------------------------------------------
def test_gc_aborts_when_a_manifest_read_fails_with_eio(tmp_path, monkeypatch):
    """One EIO on a manifest used to make gc treat it as absent and delete its chunks."""
    _save(tmp_path, {1: 1.0, 2: 2.0})
    victim = step_name(1)
    real_read = LocalBackend.read

    def read(self, path):
        if path == victim:
            raise StorageError(f"could not read {path}: Input/output error")
        return real_read(self, path)

    monkeypatch.setattr(LocalBackend, "read", read)
    # a fresh manifest cache: the manifest must be read (a new version on disk)
    os.utime(tmp_path / victim, ns=(1, 1))
    before = _chunks(tmp_path)
    res = collect_garbage(CheckpointStore(LocalBackend(tmp_path)))
    assert _chunks(tmp_path) == before  # step 1's chunks were deleted here
    assert res.chunks_deleted == 0
    assert res.skipped is not None and "nothing was deleted" in res.skipped
    monkeypatch.setattr(LocalBackend, "read", real_read)
    assert torch.equal(_restore(tmp_path, 1), torch.full((4096,), 1.0))


def test_gc_aborts_on_an_unreadable_pin(tmp_path):
    _save(tmp_path, {1: 1.0})
    orphan = "d" * 32
    store = CheckpointStore(LocalBackend(tmp_path))
    store.backend.put(f"chunks/dd/{orphan}", [b"x"])
    store.backend.put(f"{PIN_DIR}/torn.json", [b'{"host": "x", "pid"'])
    res = collect_garbage(store, full=True)
    assert res.skipped is not None and "unreadable" in res.skipped
    assert orphan in _chunks(tmp_path)
    (tmp_path / PIN_DIR / "torn.json").unlink()
    assert collect_garbage(store, full=True).chunks_deleted == 1
    assert orphan not in _chunks(tmp_path)


def test_a_torn_pin_of_a_dead_writer_does_not_stop_gc_for_good(tmp_path):
    """A pin left torn by a writer that is gone (found by the torture harness: seeds 10, 30 and
    36 at 1500 operations) stopped every later gc until removed by hand. Its name says who
    wrote it: this host and a pid that is not alive make it an expired pin, removed with a full
    sweep; the same torn pin of a live writer still stops gc (fail closed)."""
    _save(tmp_path, {1: 1.0})
    orphan = "e" * 32
    store = CheckpointStore(LocalBackend(tmp_path))
    store.backend.put(f"chunks/ee/{orphan}", [b"x"])
    live = new_record(kind="save", step=2)  # this process: alive
    store.backend.put(live.path, [b'{"host": "x", "pid"'])
    res = collect_garbage(store, full=True)
    assert res.skipped is not None and "unreadable" in res.skipped
    assert orphan in _chunks(tmp_path)
    (tmp_path / live.path).unlink()
    dead = new_record(kind="save", step=2)
    dead.name = dead.name.replace(f"-{os.getpid()}-", f"-{2**22 + 54321}-", 1)  # never alive
    store.backend.put(dead.path, [b'{"host": "x", "pid"'])
    res = collect_garbage(store)
    assert res.skipped is None and res.full
    assert orphan not in _chunks(tmp_path) and not (tmp_path / dead.path).exists()


def test_gc_honours_pins_of_live_processes_and_expires_dead_ones(tmp_path):
    _save(tmp_path, {1: 1.0})
    store = CheckpointStore(LocalBackend(tmp_path))
    kept, freed = "a" * 32, "b" * 32
    for h in (kept, freed):
        store.backend.put(f"chunks/{h[:2]}/{h}", [b"y"])
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        live = new_record(kind="promote", step=1, hashes=[kept])
        live.pid = sleeper.pid
        dead = new_record(kind="save", step=2, hashes=[freed])
        dead.pid = 2**22 + 12345  # above pid_max on Linux: never alive
        write_pin(store.backend, live)
        write_pin(store.backend, dead)
        res = collect_garbage(store)
        assert res.skipped is None and res.full  # an expired pin triggers a full sweep
        assert kept in _chunks(tmp_path) and freed not in _chunks(tmp_path)
        assert not (tmp_path / dead.path).exists() and (tmp_path / live.path).exists()
    finally:
        sleeper.kill()
        sleeper.wait()


def test_gc_does_not_reparse_retained_manifests_on_every_save(tmp_path, monkeypatch):
    """Every retained manifest was re-read and re-parsed after each save (8k tensors with
    KeepLast(24): save 0.85 s -> 15-20 s). Now a save's gc parses nothing it already knows."""
    calls = []
    real = manifest_mod.parse_manifest

    def counting(data, *, where="manifest"):
        calls.append(where)
        return real(data, where=where)

    monkeypatch.setattr("flashckpt.store.liveness.parse_manifest", counting)
    monkeypatch.setattr("flashckpt.store.store.parse_manifest", counting)
    with flashckpt.Checkpointer(tmp_path, keep=KeepLast(4)) as ckpt:
        for step in range(12):
            ckpt.save(step, {"w": torch.full((256,), float(step))})
        assert ckpt.steps() == [8, 9, 10, 11]
    assert calls == []  # the cache was filled from this process's own commits


# -- verified reuse and quarantine ------------------------------------------------------------
def test_truncated_chunk_is_not_reused_by_later_saves(tmp_path):
    """A truncated chunk was reused by name by every later save: all later steps unrestorable."""
    w = torch.full((4096,), 3.0)
    with flashckpt.Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, {"w": w})
        (chunk,) = _chunk_files_of(tmp_path, 1)
        chunk.write_bytes(chunk.read_bytes()[:-8])
        ckpt.save(2, {"w": w})
    assert torch.equal(_restore(tmp_path, 2), w)


def test_damaged_chunk_found_by_restore_is_quarantined_and_rewritten(tmp_path):
    """A rotted chunk (right size, wrong bytes) was reused forever after restore found it."""
    w = torch.full((4096,), 5.0)
    _save(tmp_path, {1: 5.0})
    (chunk,) = _chunk_files_of(tmp_path, 1)
    data = bytearray(chunk.read_bytes())
    data[100] ^= 0x40
    chunk.write_bytes(bytes(data))
    with flashckpt.Checkpointer(tmp_path) as ckpt:
        with pytest.raises(flashckpt.CorruptCheckpointError, match="quarantine"):
            ckpt.restore({"w": torch.zeros(4096)}, step=1)
        assert not chunk.exists()
        assert any((tmp_path / "quarantine").iterdir())
        ckpt.save(2, {"w": w})
    assert torch.equal(_restore(tmp_path, 2), w)


def test_verify_quarantines_a_damaged_chunk(tmp_path):
    _save(tmp_path, {1: 5.0})
    (chunk,) = _chunk_files_of(tmp_path, 1)
    data = bytearray(chunk.read_bytes())
    data[0] ^= 1
    chunk.write_bytes(bytes(data))
    rep = verify_step(CheckpointStore(LocalBackend(tmp_path)), 1)
    assert not rep.ok and "quarantine" in rep.problems[0]
    assert not chunk.exists()


# -- readers racing retention -----------------------------------------------------------------
def test_verify_racing_retention_reports_no_false_damage(tmp_path, monkeypatch):
    """ls/verify/restore run while training collects reported damage that was not there."""
    _save(tmp_path, {1: 1.0, 2: 2.0})
    store = CheckpointStore(LocalBackend(tmp_path))
    real = CheckpointStore.read_chunk

    def read_while_retention_runs(self, ref, *, step=None, key=None):
        if step == 1:  # retention deletes step 1 and gc its chunks, mid-read
            (tmp_path / step_name(1)).unlink()
            for p in (tmp_path / "chunks").rglob(ref.hash + "*"):
                p.unlink()
        return real(self, ref, step=step, key=key)

    monkeypatch.setattr(CheckpointStore, "read_chunk", read_while_retention_runs)
    rep = verify_step(store, 1)
    assert rep.ok and rep.vanished
    assert verify_step(store, 2).ok


def test_restore_racing_retention_does_not_journal_corrupt(tmp_path, monkeypatch):
    _save(tmp_path, {1: 1.0})
    from flashckpt.engine.restore import load

    real = load.check_chunks_present

    def racing(store, manifest, plan):
        (tmp_path / step_name(1)).unlink()
        for p in _chunk_files_of_manifest(tmp_path, manifest):
            p.unlink()
        return real(store, manifest, plan)

    monkeypatch.setattr(load, "check_chunks_present", racing)
    with flashckpt.Checkpointer(tmp_path) as ckpt:
        with pytest.raises(flashckpt.NoCheckpointError, match="not damage"):
            ckpt.restore({"w": torch.zeros(4096)}, step=1)
    events = [json.loads(x) for x in (tmp_path / "journal.jsonl").read_text().splitlines()]
    assert not any(e["event"] == "corrupt" for e in events)
    assert any(e["event"] == "vanished" for e in events)


def test_ls_skips_a_step_deleted_between_listing_and_reading(tmp_path, monkeypatch, capsys):
    """`flashckpt ls` next to a training job printed DAMAGED for steps retention had deleted."""
    from flashckpt.cli import store_cmds
    from flashckpt.engine.tiers import config as tierconfig

    _save(tmp_path, {2: 2.0})
    store = CheckpointStore(LocalBackend(tmp_path))
    listed = {1: [("local", store)], 2: [("local", store)]}  # step 1 went after the listing
    monkeypatch.setattr(tierconfig, "list_tiers", lambda *a, **k: listed)
    args = SimpleNamespace(root=str(tmp_path), memory_tier=None, remote=None)
    assert store_cmds.cmd_ls(args) == 0
    out = capsys.readouterr().out
    assert "DAMAGED" not in out and "\n2 " in out


def _chunk_files_of_manifest(root: Path, manifest) -> list[Path]:
    return [root / "chunks" / c.hash[:2] / c.hash for c in manifest.chunks]


# -- orphans ----------------------------------------------------------------------------------
def test_stale_temp_files_of_dead_processes_are_collected(tmp_path):
    """Temporary files of killed saves were never removed (16 of 36 kill trials)."""
    _save(tmp_path, {1: 1.0})
    dead = 2**22 + 777
    stale = [
        tmp_path / "chunks" / "ab" / f"{'ab' * 16}.tmp-{dead}-3",
        tmp_path / "steps" / f"000000000002.json.tmp-{dead}-4",
    ]
    mine = tmp_path / "chunks" / "ab" / f"{'ab' * 16}.tmp-{os.getpid()}-9"
    for p in [*stale, mine]:
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(b"partial")
    out = subprocess.run(
        [sys.executable, "-m", "flashckpt.cli", "gc", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "2 stale temporary files" in out.stdout
    assert not any(p.exists() for p in stale) and mine.exists()


def test_failed_save_chunks_are_collected(tmp_path, monkeypatch):
    _save(tmp_path, {1: 1.0})
    before = _chunks(tmp_path)
    from flashckpt.store import store as store_mod

    real_commit = store_mod.CheckpointStore.commit

    def full_disk(self, manifest, **kw):
        raise StorageError("could not write manifest: No space left on device")

    monkeypatch.setattr(store_mod.CheckpointStore, "commit", full_disk)
    with flashckpt.Checkpointer(tmp_path) as ckpt:
        with pytest.raises(flashckpt.FlashCkptError, match="No space left"):
            ckpt.save(2, {"w": torch.full((4096,), 2.0), "v": torch.ones(100)})
    monkeypatch.setattr(store_mod.CheckpointStore, "commit", real_commit)
    assert _chunks(tmp_path) == before
    assert not list((tmp_path / PIN_DIR).glob("*.json"))


# -- locks ------------------------------------------------------------------------------------
def test_lockf_error_other_than_held_is_a_storage_error(tmp_path, monkeypatch):
    """Any lockf error read as 'locked by another process'."""

    def no_locks(fd, mode):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(lock_mod.fcntl, "lockf", no_locks)
    with pytest.raises(StorageError, match="POSIX record locks") as info:
        WriterLock(tmp_path).acquire()
    assert not isinstance(info.value, LockedError)
    with pytest.raises(StorageError, match="POSIX record locks"):
        with RootLock(tmp_path).exclusive():
            pass


_HOLD_SHARED = """
import sys, time
from flashckpt.store.lock import RootLock
RootLock(sys.argv[1]).hold_shared()
print("held", flush=True)
time.sleep(60)
"""


def test_root_lock_is_shared_by_writers_and_exclusive_for_gc_across_processes(tmp_path):
    child = subprocess.Popen(
        [sys.executable, "-c", _HOLD_SHARED, str(tmp_path)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "held"
        lock = RootLock(tmp_path)
        lock.hold_shared()  # writers share it
        lock.release_shared()
        with lock.exclusive() as got:
            assert got is False
    finally:
        child.kill()
        child.wait()
    with RootLock(tmp_path).exclusive() as got:
        assert got is True


_SAVE_PAUSED = """
import sys, time
from pathlib import Path
import torch
import flashckpt
from flashckpt.engine.runtime import checkpointer
from flashckpt.store import lock
from flashckpt.store.store import CheckpointStore

class RankLock(lock.WriterLock):  # a distributed rank's lock name, as under torchrun
    def __init__(self, root, *, name="writer"):
        super().__init__(root, name="rank-0")

checkpointer.WriterLock = RankLock
real = CheckpointStore.commit
root = Path(sys.argv[1])

def paused(self, manifest, **kw):
    (root / "ready").touch()
    while not (root / "go").exists():
        time.sleep(0.05)
    return real(self, manifest, **kw)

CheckpointStore.commit = paused
with flashckpt.Checkpointer(root) as ckpt:
    ckpt.save(7, {"w": torch.full((4096,), 7.0)})
"""


def test_flashckpt_gc_cannot_delete_the_chunks_of_a_save_in_flight(tmp_path):
    """`flashckpt gc` took locks/writer.lock while ranks lock locks/rank-<r>.lock, so it deleted
    every chunk of a save in flight, which was then committed."""
    root = tmp_path / "ck"
    _save(root, {1: 1.0})
    saver = subprocess.Popen([sys.executable, "-c", _SAVE_PAUSED, str(root)])
    try:
        for _ in range(1200):
            if (root / "ready").exists() or saver.poll() is not None:
                break
            subprocess.run([sys.executable, "-c", "import time; time.sleep(0.1)"], check=True)
        assert (root / "ready").exists()
        gc = subprocess.run(
            [sys.executable, "-m", "flashckpt.cli", "gc", str(root)],
            capture_output=True,
            text=True,
            timeout=120,
        )
        # a writer holds the root: not damage, an error that says to try again (exit 2)
        assert gc.returncode == 2 and "nothing was deleted" in gc.stderr, gc
        (root / "go").touch()
        assert saver.wait(timeout=120) == 0
    finally:
        if saver.poll() is None:
            saver.kill()
            saver.wait()
    assert torch.equal(_restore(root, 7), torch.full((4096,), 7.0))
    events = [json.loads(x) for x in (root / "journal.jsonl").read_text().splitlines()]
    assert any(e["event"] == "gc_skipped" for e in events)


def test_gc_module_has_no_other_deleter():
    """Nobody but the gc module deletes chunk files (one owner)."""
    src = Path(gc_mod.__file__).parent.parent
    offenders = []
    for p in src.rglob("*.py"):
        text = p.read_text()
        if "backend.delete(chunk_path" in text or "delete(chunk_path" in text:
            offenders.append(str(p.relative_to(src)))
    assert offenders == []


_TRAIN = """
import sys
from pathlib import Path
import torch
import flashckpt
root = Path(sys.argv[1])
with flashckpt.Checkpointer(root, keep=3) as ckpt:
    for step in range(1, 41):  # step 0 is committed already, and a step is saved once
        ckpt.save(step, {f"t{i}": torch.full((2048,), float(step * 8 + i)) for i in range(8)})
(root / "done").touch()
"""


def test_gc_and_readers_of_another_process_next_to_a_training_process(tmp_path):
    """A real trainer saves with retention while this process collects garbage and verifies:
    gc never deletes what a save in flight or a kept step needs, and no step is reported
    damaged (a step retention deleted mid-read is 'vanished')."""
    root = tmp_path / "ck"
    _save(root, {0: 0.0})
    trainer = subprocess.Popen([sys.executable, "-c", _TRAIN, str(root)])
    store = CheckpointStore(LocalBackend(root))
    problems, rounds = [], 0
    try:
        while not (root / "done").exists() and trainer.poll() is None:
            collect_garbage(store, full=True)
            for step in store.steps():
                rep = verify_step(store, step)
                problems += rep.problems
            rounds += 1
        assert trainer.wait(timeout=300) == 0
    finally:
        if trainer.poll() is None:
            trainer.kill()
            trainer.wait()
    assert rounds > 0 and problems == []
    assert store.steps() == [38, 39, 40]
    for step in store.steps():
        assert verify_step(store, step).ok
