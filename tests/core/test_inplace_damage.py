"""Issue 27: a chunk damaged in place without changing its size is never reused.

A flipped byte written with ``pwrite`` (``dd conv=notrunc``), a hole punched with
``fallocate(PUNCH_HOLE | KEEP_SIZE)`` or a damaged zstd frame keeps the chunk's size, which was
all the liveness module checked before: the next incremental save named the damaged chunk, was
reported durable, and could not be restored. Now a chunk is reused only while its file shows
the stamp taken when this process wrote it or verified its bytes (store/liveness.py), on the
disk tier and on the memory tier alike, and an ordinary save/save/save still reuses everything.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import shutil
import time
from pathlib import Path

import pytest
import torch

import flashckpt

FALLOC_FL_KEEP_SIZE, FALLOC_FL_PUNCH_HOLE = 0x01, 0x02
CHUNK = "64KiB"


@pytest.fixture
def mem_dir(tmp_path):
    """A memory-tier directory: under /dev/shm (tmpfs) when there is one, else tmp_path."""
    shm = Path("/dev/shm")
    mem = (
        shm if shm.is_dir() else tmp_path
    ) / f"flashckpt-test-inplace-{os.getpid()}-{id(tmp_path)}"
    yield mem
    shutil.rmtree(mem, ignore_errors=True)


def _state(*, compressible: bool) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    if compressible:  # small integers: zstd (byte-shuffled) shrinks them, so chunks stay .zst
        return {f"t{i}": torch.randint(0, 4, (64 << 10,), generator=g).float() for i in range(3)}
    return {f"t{i}": torch.randn(64 << 10, generator=g) for i in range(3)}


def _chunk_files(root: Path) -> list[Path]:
    return sorted(p for p in (root / "chunks").rglob("*") if p.is_file() and ".tmp-" not in p.name)


def _flip(path: Path) -> None:
    fd = os.open(path, os.O_RDWR)
    try:
        off = os.fstat(fd).st_size // 2
        (b,) = os.pread(fd, 1, off)
        os.pwrite(fd, bytes([b ^ 0x10]), off)  # same size, bytes changed in place
    finally:
        os.close(fd)


def _punch(path: Path) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(path, os.O_RDWR)
    try:
        rc = libc.fallocate(
            fd,
            FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE,
            ctypes.c_long(4096),
            ctypes.c_long(8192),
        )
        err = ctypes.get_errno()
    finally:
        os.close(fd)
    if rc != 0:
        if err in (errno.EOPNOTSUPP, errno.ENOSYS):
            pytest.skip(f"fallocate(PUNCH_HOLE) is not supported on the filesystem of {path}")
        raise OSError(err, os.strerror(err), str(path))


def _damage(path: Path, how: str) -> None:
    before = os.stat(path)
    # kernels before 6.13 stamp mtime/ctime to a clock tick: damage in the tick of the write
    # would look unchanged (left to the scrub); wait one tick so the test means what it says
    time.sleep(0.02)
    _punch(path) if how == "hole" else _flip(path)
    after = os.stat(path)
    assert after.st_size == before.st_size, "the damage must keep the chunk's size"


def _journal(root: Path) -> list[dict]:
    return [json.loads(x) for x in (root / "journal.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("tier", ["disk", "memory"])
@pytest.mark.parametrize("damage", ["flip", "hole", "zstd"])
def test_regression_same_size_damage_is_not_reused(tmp_path, mem_dir, tier, damage):
    """Step 1 saved, one of its chunks damaged in place (same size), step 2 of the same state
    saved incrementally: step 2 is durable and restores bit for bit (it used to name the
    damaged chunk and fail with CorruptCheckpointError)."""
    compression = "zstd" if damage == "zstd" else None
    state = _state(compressible=damage == "zstd")
    expected = {k: v.clone() for k, v in state.items()}
    root = tmp_path / "root"
    kw = dict(memory_tier=mem_dir, keep_memory_after_close=True) if tier == "memory" else {}
    with flashckpt.Checkpointer(
        root, async_save=True, compression=compression, chunk_size=CHUNK, **kw
    ) as ckpt:
        first = ckpt.save(1, state).durable.result(timeout=60)
        assert first.chunks_new >= 3
        ckpt.wait_promoted(timeout_s=60)  # step 1 on disk too: the damage is the tier's only
        where = mem_dir if tier == "memory" else root
        files = _chunk_files(where)
        if damage == "zstd":
            files = [p for p in files if p.suffix.startswith(".zs")]
            assert files, "the compressible state should be stored as zstd frames"
        victim = max(files, key=lambda p: p.stat().st_size)
        _damage(victim, "hole" if damage == "hole" else "flip")

        second = ckpt.save(2, state).durable.result(timeout=60)  # incremental, same state
        assert second.chunks_new >= 1, "the damaged chunk must be written again"
        assert second.chunks_reused >= 1, "the undamaged chunks are still reused"

        out = {k: torch.zeros_like(v) for k, v in state.items()}
        assert ckpt.restore(out, step=2) == 2
    for k in expected:
        assert torch.equal(out[k], expected[k]), k
    restores = [e for e in _journal(root) if e["event"] == "restore" and e["step"] == 2]
    assert restores and restores[-1]["tier"] == ("memory" if tier == "memory" else "local")


@pytest.mark.parametrize("tier", ["disk", "memory"])
@pytest.mark.parametrize("async_save", [False, True])
def test_unchanged_saves_keep_reusing_every_chunk(tmp_path, mem_dir, tier, async_save):
    """The stamps cost nothing on the ordinary path: save/save/save of an unchanged state
    writes its chunks once (memory tier: also when staging wrote them straight into the
    tier's files), and so does the first save after a restart that restored the state."""
    state = _state(compressible=False)
    root = tmp_path / "root"
    kw = dict(memory_tier=mem_dir, keep_memory_after_close=True) if tier == "memory" else {}
    with flashckpt.Checkpointer(root, async_save=async_save, chunk_size=CHUNK, **kw) as ckpt:
        stats = [ckpt.save(s, state).wait(timeout=60) for s in (1, 2, 3)]
    assert stats[0].chunks_new >= 3 and stats[0].new_bytes == stats[0].total_bytes
    for s in stats[1:]:
        assert s.new_bytes == 0 and s.chunks_new == 0, s
        assert s.chunks_reused == stats[0].chunks_new
    with flashckpt.Checkpointer(root, async_save=async_save, chunk_size=CHUNK, **kw) as ckpt:
        out = {k: torch.zeros_like(v) for k, v in state.items()}
        assert ckpt.restore(out) == 3  # a restart: the restore verified (and stamped) them
        after = ckpt.save(4, out).wait(timeout=60)
    assert after.new_bytes == 0 and after.chunks_reused == stats[0].chunks_new, after


def test_a_new_process_rewrites_chunks_it_never_verified(tmp_path):
    """Without a restore a new process has verified nothing: it writes its chunks again rather
    than trusting bytes it never read (and, after a restore, reuses them: above)."""
    state = _state(compressible=False)
    with flashckpt.Checkpointer(tmp_path, chunk_size=CHUNK) as ckpt:
        ckpt.save(1, state).wait()
    files = _chunk_files(tmp_path)
    _damage(files[0], "flip")
    from flashckpt.store.liveness import _registry

    _registry.clear()  # what a new process knows: nothing
    # (no idle scrub: it could verify the good chunks first on a slow host)
    with flashckpt.Checkpointer(tmp_path, chunk_size=CHUNK, scrub_bytes_per_s=0) as ckpt:
        again = ckpt.save(2, state).wait()
        out = {k: torch.zeros_like(v) for k, v in state.items()}
        assert ckpt.restore(out, step=2) == 2
    assert again.chunks_reused == 0 and again.new_bytes == again.total_bytes
    for k in state:
        assert torch.equal(out[k], state[k]), k
