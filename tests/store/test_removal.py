"""The system calls a save makes per chunk: removing its garbage in one pass
(store/files/removal.py, gc's ``_delete``) and stamping what it wrote from the writer's fd.

gc used to size and delete each garbage chunk by walking down from the root once per codec
suffix it might have (five) and once more to delete it: about thirty system calls per chunk,
each a GIL hand-off with a training thread; stamping a chunk just written walked down
again to stat it. These tests hold the class: what one collection
opens, that every file of a chunk is still found (two codecs), and that the batch keeps the
gateway's rules (nothing through a symlink, nothing but regular files removed).
"""

from __future__ import annotations

import os
import shutil
import sys
import threading
from pathlib import Path

import torch

import flashckpt
from flashckpt.store.files.backend import LocalBackend
from flashckpt.store.gc import collect_garbage
from flashckpt.store.store import CheckpointStore

_events: list[tuple[int, str, tuple]] = []
_watching: set[int] = set()


def _hook(event: str, args: tuple) -> None:
    if threading.get_ident() in _watching and event in ("open", "os.remove", "os.rename"):
        _events.append((threading.get_ident(), event, args))


sys.addaudithook(_hook)


def _counted(fn):
    """Run ``fn()`` in this thread and return (its result, the file opens it made)."""
    _events.clear()
    _watching.add(threading.get_ident())
    try:
        out = fn()
    finally:
        _watching.discard(threading.get_ident())
    return out, [e for e in _events if e[1] == "open"]


N = 1 << 18  # 1 MiB of float32: a chunk of its own (not packed)


def _state(seed: float, n: int) -> dict[str, torch.Tensor]:
    return {f"t{i}": torch.full((N,), seed + i) for i in range(n)}


def _chunk_files(root: Path) -> list[Path]:
    return [p for p in (root / "chunks").rglob("*") if p.is_file()]


def test_collecting_a_saves_garbage_opens_each_directory_once(tmp_path):
    n = 40
    with flashckpt.Checkpointer(tmp_path, keep=10) as ck:
        ck.save(1, _state(1.0, n))
        ck.save(2, _state(1000.0, n))
    store = CheckpointStore(LocalBackend(tmp_path))
    collect_garbage(store)  # a process's first collection sweeps every file: not measured
    before = set(_chunk_files(tmp_path))
    store.delete_step(1)
    res, opens = _counted(lambda: collect_garbage(store))
    gone = before - set(_chunk_files(tmp_path))
    assert res.chunks_deleted == len(gone) >= n
    dirs = {p.parent for p in gone}
    # each chunk directory once, plus nine for the collection itself (the root four times,
    # locks/, the lock file, steps/, pins/, chunks/); before: some fifteen opens per chunk
    assert len(opens) <= len(dirs) + 10, (len(opens), len(dirs))
    assert all(p.exists() for p in before - gone)  # step 2's chunks stay
    out = {k: torch.zeros(N) for k in _state(0.0, n)}
    with flashckpt.Checkpointer(tmp_path) as ck:
        assert ck.restore(out) == 2
    assert torch.equal(out["t3"], torch.full((N,), 1003.0))


def test_a_chunk_stored_in_two_codecs_loses_both_files_when_it_becomes_garbage(tmp_path):
    """A chunk written raw, then again compressed by a process that had not verified the raw
    copy (a new process, another compression setting), has two files; gc deletes both."""
    same = {"w": (torch.arange(65536) % 7).float()}
    raw_root = tmp_path / "raw"
    with flashckpt.Checkpointer(raw_root, keep=10) as ck:
        ck.save(1, same)
    root = tmp_path / "both"
    shutil.copytree(raw_root, root)  # another root: no stamps of this process's writes
    with flashckpt.Checkpointer(root, keep=1, compression="zstd") as ck:
        ck.save(2, same)
        names = sorted(p.name for p in _chunk_files(root))
        assert len(names) == 2 and names[1].startswith(names[0] + "."), names  # raw and zstd
        ck.save(3, {"w": torch.ones(65536)})
        ck.save(4, {"w": torch.full((65536,), 2.0)})
    left = {p.name for p in _chunk_files(root)}
    assert not any(n.startswith(names[0]) for n in left), (names, left)


def test_remove_files_keeps_the_gateways_rules(tmp_path):
    from flashckpt.store.files import removal

    root = tmp_path / "root"
    outside = tmp_path / "outside"
    (root / "chunks" / "aa").mkdir(parents=True)
    outside.mkdir()
    (root / "chunks" / "aa" / "one").write_bytes(b"x" * 10)
    (outside / "two").write_bytes(b"keep")
    (root / "chunks" / "bb").symlink_to(outside)  # a planted link to a directory
    (root / "chunks" / "aa" / "link").symlink_to(outside / "two")
    os.mkfifo(root / "chunks" / "aa" / "fifo")
    (root / "chunks" / "aa" / "sub").mkdir()
    got = removal.remove_files(
        root,
        [
            "chunks/aa/one",
            "chunks/bb/two",
            "chunks/aa/link",
            "chunks/aa/fifo",
            "chunks/aa/sub",
            "chunks/aa/missing",
            "chunks/cc/missing",
        ],
    )
    assert got == [10, -1, -1, -1, -1, -1, -1]
    assert not (root / "chunks" / "aa" / "one").exists()
    assert (outside / "two").read_bytes() == b"keep"  # nothing through the link
    assert (root / "chunks" / "aa" / "link").is_symlink()  # left alone, not followed
    assert (root / "chunks" / "aa" / "fifo").exists()
    assert (root / "chunks" / "aa" / "sub").is_dir()


def test_remove_files_never_writes_below_a_directory_others_may_write(tmp_path):
    from flashckpt.store.files import removal

    root = tmp_path / "root"
    (root / "chunks" / "aa").mkdir(parents=True)
    (root / "chunks" / "aa" / "one").write_bytes(b"x")
    os.chmod(root / "chunks" / "aa", 0o777)  # world-writable, no sticky bit
    assert removal.remove_files(root, ["chunks/aa/one"]) == [-1]
    assert (root / "chunks" / "aa" / "one").exists()


def test_a_written_chunk_is_stamped_from_the_writers_own_fd(tmp_path):
    """put_chunk stamped the chunk it had just written by walking down from the root again to
    stat it (three more opens per chunk); the stamp now comes from the writer's fstat after
    the rename, and is the same key a later lstat finds, so the next save still reuses it."""
    store = CheckpointStore(LocalBackend(tmp_path))
    store.put_chunk("ab" + "cd" * 15, 8, [b"warm up."], "raw")  # the index, dirs, mountinfo
    h = "ab" * 16
    _, opens = _counted(lambda: store.put_chunk(h, 8, [b"12345678"], "raw"))
    names = [e[2][0] for e in opens]
    # the root, chunks/, chunks/ab and the temporary file: nothing after the rename
    assert len(names) == 4 and names[1:3] == ["chunks", "ab"], names
    assert names[3].startswith(f"{h}.tmp-"), names
    assert store.liveness.find(h, 8) is not None  # stamped: reusable without reading it
    os.utime(tmp_path / "chunks" / "ab" / h, ns=(1, 1))  # changed behind the stamp's back
    assert store.liveness.find(h, 8) is None  # written again, not trusted


def test_last_stat_answers_only_for_this_threads_last_put_or_map_of_that_path(tmp_path):
    backend = LocalBackend(tmp_path)
    backend.put("chunks/aa/one", [b"1"])
    assert backend.last_stat("chunks/aa/two") is None
    backend.put("chunks/aa/one", [b"22"])
    other: list = []
    t = threading.Thread(target=lambda: other.append(backend.last_stat("chunks/aa/one")))
    t.start()
    t.join()
    assert other == [None]  # another thread's put is not this one's
    st = backend.last_stat("chunks/aa/one")
    assert st is not None and st.st_size == 2
    assert st.st_ino == os.stat(tmp_path / "chunks" / "aa" / "one").st_ino
    assert backend.last_stat("chunks/aa/one") is None  # answered once
    mapped = backend.map("chunks/aa/one")
    assert bytes(mapped) == b"22"
    mapped.close()
    assert backend.last_stat("chunks/aa/one").st_ino == st.st_ino


def test_a_mapped_chunk_is_verified_and_stamped_from_the_readers_own_fd(tmp_path):
    """Promotion maps each memory-tier chunk to verify it; the stamp of that verification
    came from a walk down from the root to stat the file first (three more opens a chunk)."""
    store = CheckpointStore(LocalBackend(tmp_path))
    store.put_chunk("ab" + "cd" * 15, 8, [b"warm up."], "raw")  # the index, mountinfo
    from flashckpt.store.format import codec as codecs

    data = b"verified" * 512
    h = codecs.hash_parts([data])
    ref = store.put_chunk(h, len(data), [data], "raw")
    store.liveness.forget(h)  # as a new process: nothing verified yet
    raw, opens = _counted(lambda: store.map_chunk(ref))
    assert bytes(raw) == data
    names = [e[2][0] for e in opens]
    assert len(names) == 4 and names[1:3] == ["chunks", h[:2]] and names[3] == h, names
    assert store.liveness.find(h, len(data)) is not None  # verified: reusable


def test_syncing_many_directories_opens_their_shared_parents_once(tmp_path):
    """A promotion's commit makes the renames of every chunk directory durable; each fsync
    walked down from the root (three opens for chunks/xx): now the root and chunks/ once."""
    backend = LocalBackend(tmp_path)
    dirs = [f"chunks/{i:02x}" for i in range(40)]
    for d in dirs:
        backend.put(f"{d}/{d[-2:]}00", [b"x"])
    _, opens = _counted(lambda: backend.sync_dirs([*dirs, "chunks/ff", "steps"]))
    names = [e[2][0] for e in opens]
    # the root and chunks/ once, each chunks/xx once, and one try each for the two missing
    assert names[:2] == [str(tmp_path), "chunks"] and len(names) == 2 + 40 + 2, names
    assert names.count("chunks") == 1
