"""Chunk files written past the page cache (O_DIRECT) where the bytes allow it, buffered
where they do not, and byte-identical either way."""

from __future__ import annotations

import errno
import fcntl
import mmap
import os

import numpy as np
import pytest

import flashckpt
from flashckpt.store.files import directio
from flashckpt.store.files.backend import LocalBackend
from flashckpt.store.files.directio import ALIGN, write_parts


def _aligned(nbytes: int, seed: int = 0) -> np.ndarray:
    """``nbytes`` of random bytes starting on a page boundary."""
    buf = np.frombuffer(mmap.mmap(-1, max(nbytes, 1)), dtype=np.uint8)[:nbytes]
    buf[:] = np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)
    return buf


@pytest.mark.parametrize(
    "parts",
    [
        [(ALIGN * 8, 0)],  # aligned, whole blocks: all direct
        [(ALIGN * 8 + 123, 0)],  # aligned with a tail: bulk direct, tail buffered
        [(ALIGN * 4 + 7, 1)],  # unaligned address: buffered
        [(ALIGN * 2, 0), (100, 0), (ALIGN * 3, 0)],  # second part leaves the file unaligned
        [(10, 0), (ALIGN * 2, 0)],  # aligned buffer at an unaligned file offset
        [(0, 0), (ALIGN, 0)],  # an empty part
    ],
)
def test_write_parts_stores_exact_bytes_whatever_the_alignment(tmp_path, parts):
    bufs = []
    for i, (n, skew) in enumerate(parts):
        raw = _aligned(n + skew, seed=i)
        bufs.append(raw[skew : skew + n])
    path = tmp_path / "chunk"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        res = write_parts(fd, bufs, direct=True)
        os.fsync(fd)
    finally:
        os.close(fd)
    expected = b"".join(b.tobytes() for b in bufs)
    assert path.read_bytes() == expected
    assert res.written == len(expected)
    assert res.direct_bytes % ALIGN == 0 and res.direct_bytes <= len(expected)
    if parts == [(ALIGN * 8, 0)] and directio.supported(tmp_path):
        assert res.direct_bytes == ALIGN * 8 and not res.direct_refused


def test_disk_tier_writes_staged_chunks_past_the_page_cache(tmp_path, make_state, state_equal):
    state = make_state(width=256)
    with flashckpt.Checkpointer(tmp_path, async_save=True, chunk_size="64KiB") as ck:
        ck.save(1, state).wait()
        direct = ck.store.backend.direct_bytes
    if directio.supported(tmp_path):
        assert direct > 0, "staged chunks are page-aligned and should be written with O_DIRECT"
    else:
        assert direct == 0
    fresh = make_state(width=256, seed=3)
    with flashckpt.Checkpointer(tmp_path) as ck:
        assert ck.restore(fresh) == 1
    state_equal(fresh, state)


def test_direct_io_off_writes_through_the_page_cache(tmp_path, make_state):
    with flashckpt.Checkpointer(tmp_path, async_save=True, direct_io=False) as ck:
        ck.save(1, make_state()).wait()
        assert ck.store.backend.direct_bytes == 0


def test_direct_io_must_be_a_bool(tmp_path):
    with pytest.raises(flashckpt.ConfigError, match="direct_io must be True or False"):
        flashckpt.Checkpointer(tmp_path, direct_io="yes")  # type: ignore[arg-type]


def test_filesystem_refusing_o_direct_falls_back_to_buffered_writes(tmp_path, monkeypatch):
    real = fcntl.fcntl

    def no_direct(fd, cmd, arg=0):
        if cmd == fcntl.F_SETFL and arg & directio.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")  # what such a filesystem answers
        return real(fd, cmd, arg)

    monkeypatch.setattr(directio.fcntl, "fcntl", no_direct)
    backend = LocalBackend(tmp_path, direct_io=True)
    data = _aligned(ALIGN * 16)
    backend.put("chunks/ab/one", [data])
    assert backend.read("chunks/ab/one") == data.tobytes()
    assert backend.direct_io is False, "the backend stops asking after a refusal"
    assert backend.direct_bytes == 0


def test_device_refusing_the_alignment_mid_write_finishes_buffered(tmp_path, monkeypatch):
    real_write = os.write
    calls = {"direct": 0}

    def picky(fd, data):
        if fcntl.fcntl(fd, fcntl.F_GETFL) & directio.O_DIRECT:
            calls["direct"] += 1
            raise OSError(errno.EINVAL, "Invalid argument")  # e.g. an 8 KiB logical block
        return real_write(fd, data)

    monkeypatch.setattr(directio.os, "write", picky)
    backend = LocalBackend(tmp_path, direct_io=True)
    data = _aligned(ALIGN * 16 + 5)
    backend.put("chunks/cd/two", [data])
    assert backend.read("chunks/cd/two") == data.tobytes()
    if directio.supported(tmp_path):
        assert calls["direct"] == 1 and backend.direct_io is False


def test_write_errors_other_than_einval_still_raise(tmp_path, monkeypatch):
    def full(fd, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(directio.os, "write", full)
    backend = LocalBackend(tmp_path, direct_io=True)
    with pytest.raises(flashckpt.StorageError, match="No space left"):
        backend.put("chunks/ef/three", [_aligned(ALIGN * 4)])
    assert backend.list("chunks/ef") == [] and backend.list_temp("chunks/ef") == []
