"""The disk tier writes over the chunk files retention freed (store/files/staged.py FreePool),
as the memory tier does: no inode or block allocated and freed per chunk per save (on the CI
VM's ext4, 0.54x the wall time of new files: benchmarks/file_churn.py)."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
import torch

import flashckpt
from flashckpt.store.files import backend as backends
from flashckpt.store.files.backend import LocalBackend
from flashckpt.store.files.staged import FREE_DIR

SIZE = 16 * 4096


def _chunk_inodes(root: Path) -> dict[str, int]:
    return {p.name: p.stat().st_ino for p in (root / "chunks").rglob("*") if p.is_file()}


def _state(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return {f"t{i}": torch.randn(1 << 18, generator=g) for i in range(3)}


@pytest.mark.parametrize("async_save", [False, True])
def test_the_disk_tier_writes_over_the_files_retention_freed(
    tmp_path: Path, async_save: bool
) -> None:
    root = tmp_path / "ck"
    seen: set[int] = set()
    reused = 0
    with flashckpt.Checkpointer(root, keep=1, async_save=async_save) as ck:
        for step in range(1, 7):
            before = set(_chunk_inodes(root).values())
            ck.save(step, _state(step))
            ck.wait()
            new = set(_chunk_inodes(root).values()) - before
            reused += len(new & seen)  # a chunk of this save in the file of an older one
            seen |= before
    assert reused >= 3 * 3, reused  # from the third save on, every chunk
    assert not (root / FREE_DIR).exists() or not any((root / FREE_DIR).iterdir())
    for step in (6,):
        got = {k: torch.empty_like(v) for k, v in _state(step).items()}
        assert flashckpt.restore(root, got) == step
        assert all(torch.equal(got[k], v) for k, v in _state(step).items())


def test_a_reader_keeps_the_bytes_of_a_freed_chunk_it_has_open(tmp_path: Path) -> None:
    """gc may free a chunk a restore (another process, a backup) has open: the write lease
    refuses that file to the pool's next write, which takes a new file instead."""
    b = LocalBackend(tmp_path / "root")
    b.recycle_bytes = 1 << 30
    b.put("chunks/ab/ab00", [b"a" * SIZE])
    with open(tmp_path / "root" / "chunks" / "ab" / "ab00", "rb") as reader:
        assert b.recycle("chunks/ab/ab00") == SIZE
        b.put("chunks/cd/cd00", [b"c" * SIZE])
        assert reader.read() == b"a" * SIZE
    assert (tmp_path / "root" / "chunks" / "cd" / "cd00").read_bytes() == b"c" * SIZE


def test_a_full_disk_gets_the_pools_files_back_before_a_write_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    b = LocalBackend(tmp_path / "root")
    b.recycle_bytes = 1 << 30
    for i in range(2):
        b.put(f"chunks/ab/ab0{i}", [os.urandom(SIZE)])
        assert b.recycle(f"chunks/ab/ab0{i}") == SIZE
    real = backends.write_parts
    full = {"on": True}

    def write_parts(fd: int, parts: object, *, direct: bool) -> object:
        if full["on"] and any((tmp_path / "root" / FREE_DIR).iterdir()):
            raise OSError(errno.ENOSPC, "No space left on device (injected)")
        return real(fd, parts, direct=direct)  # type: ignore[arg-type]

    monkeypatch.setattr(backends, "write_parts", write_parts)
    b.put("chunks/ef/ef00", [b"e" * (2 * SIZE)])  # no pooled file of this size: a new one
    assert (tmp_path / "root" / "chunks" / "ef" / "ef00").read_bytes() == b"e" * (2 * SIZE)
    assert not any((tmp_path / "root" / FREE_DIR).iterdir())
    full["on"] = False


def test_a_full_disk_with_an_empty_pool_still_fails_clearly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    b = LocalBackend(tmp_path / "root")
    b.recycle_bytes = 1 << 30

    def write_parts(fd: int, parts: object, *, direct: bool) -> object:
        raise OSError(errno.ENOSPC, "No space left on device (injected)")

    monkeypatch.setattr(backends, "write_parts", write_parts)
    with pytest.raises(flashckpt.StorageError, match="No space left"):
        b.put("chunks/ef/ef00", [b"e" * SIZE])
    assert not list((tmp_path / "root" / "chunks" / "ef").iterdir())  # no temporary left


def test_a_filesystem_without_leases_pools_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Nothing proves a file unused where the filesystem grants no lease (NFS): the first
    refusal ends pooling for the backend, and freed files are deleted as before."""
    from flashckpt.store.files import staged

    b = LocalBackend(tmp_path / "root")
    b.recycle_bytes = 1 << 30
    b.put("chunks/ab/ab00", [b"a" * SIZE])
    assert b.recycle("chunks/ab/ab00") == SIZE
    real = staged.fcntl.fcntl

    def fcntl(fd: int, cmd: int, arg: int = 0) -> object:
        if cmd == staged.fcntl.F_SETLEASE:
            raise OSError(errno.EINVAL, "Invalid argument (no leases here)")
        return real(fd, cmd, arg)

    monkeypatch.setattr(staged.fcntl, "fcntl", fcntl)
    b.put("chunks/cd/cd00", [b"c" * SIZE])
    assert (tmp_path / "root" / "chunks" / "cd" / "cd00").read_bytes() == b"c" * SIZE
    assert b.recycle("chunks/cd/cd00") == -1  # deleted by its caller, not kept
    assert not any((tmp_path / "root" / FREE_DIR).iterdir())


@pytest.mark.parametrize("kind", ["symlink", "hardlink", "fifo", "dir", "foreign", "wrong_size"])
def test_a_planted_pool_entry_is_never_written_through(tmp_path: Path, kind: str) -> None:
    """Whatever sits in ``staging/free/`` under a pooled file's name (the disk root is a
    directory other tools and users can reach): a write never goes through it into another
    file, is never lost, and the entry is not used."""
    root = tmp_path / "root"
    b = LocalBackend(root)
    b.recycle_bytes = 1 << 30
    outside = tmp_path / "outside"
    outside.write_bytes(b"o" * SIZE)
    free = root / FREE_DIR
    free.mkdir(parents=True)
    planted = free / f"{SIZE}-1-1.free"
    if kind == "symlink":
        planted.symlink_to(outside)
    elif kind == "hardlink":
        os.link(outside, planted)
    elif kind == "fifo":
        os.mkfifo(planted)
    elif kind == "dir":
        planted.mkdir()
    elif kind == "foreign":
        planted.write_bytes(b"f" * SIZE)
        os.chown(planted, 65534, 65534)
    else:
        planted.write_bytes(b"w" * (SIZE + 1))
    b.put("chunks/ab/ab00", [b"n" * SIZE])
    assert (root / "chunks" / "ab" / "ab00").read_bytes() == b"n" * SIZE
    assert outside.read_bytes() == b"o" * SIZE
    assert os.stat(root / "chunks" / "ab" / "ab00").st_nlink == 1
    assert os.listdir(root / "chunks" / "ab") == ["ab00"]  # nothing left under a temp name
