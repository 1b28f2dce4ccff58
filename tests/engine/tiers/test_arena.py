"""The staging arena as a file in a tmpfs memory tier (engine/tiers/arena.py).

A process killed with SIGKILL leaves the file; the next start maps the same pages, already
allocated, so its first save stages into resident memory. A clean close removes it. Anything
but this user's own regular file with one link in its place is left alone, a full tmpfs or a
tight one falls back to anonymous memory, and stale bytes in the file never reach a checkpoint.

The arena stages into a memory tier only where the bytes still pass through it: with
compression (the workers compress the staged bytes on their way into the tier), so these tests
save with ``compression="zstd"``. An uncompressed CPU state is staged straight into the tier's
chunk files and needs no arena (tests/engine/save/test_direct.py).
"""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import textwrap
from collections import namedtuple
from pathlib import Path

import pytest
import torch

import flashckpt
from flashckpt.engine.save.staging import StagingPool
from flashckpt.engine.tiers import arena
from flashckpt.engine.tiers.arena import ArenaFile

MiB = 1 << 20
ARENA = "staging/writer.arena"  # a single process's writer lock is "writer"


def _state(v: float) -> dict[str, torch.Tensor]:
    return {"w": torch.arange(2 * MiB, dtype=torch.float32) + v}  # 8 MiB


def _tier(shm_dir: Path) -> Path:
    shm_dir.mkdir(mode=0o700)
    return shm_dir


KILLED_RUN = textwrap.dedent(
    """
    import os, signal, sys
    import torch
    import flashckpt
    ck = flashckpt.Checkpointer(sys.argv[1], memory_tier=sys.argv[2], async_save=True,
                                 compression="zstd")
    state = {"w": torch.arange(2 << 20, dtype=torch.float32) + 1.0}
    ck.save(1, state).durable.result()
    print(int(ck._pool.file_backed), ck._pool.capacity_bytes, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
    """
)


def test_a_restart_after_sigkill_maps_the_arena_the_killed_process_left(
    tmp_path: Path, shm_dir: Path
) -> None:
    root = tmp_path / "root"
    res = subprocess.run(
        [sys.executable, "-c", KILLED_RUN, str(root), str(shm_dir)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert res.returncode == -signal.SIGKILL, res.stderr
    backed, capacity = (int(x) for x in res.stdout.split())
    assert backed == 1
    left = os.stat(shm_dir / ARENA)
    assert left.st_size == capacity and left.st_blocks * 512 >= capacity

    ck = flashckpt.Checkpointer(root, memory_tier=shm_dir, async_save=True, compression="zstd")
    state = _state(-5.0)
    assert ck.restore(state) == 1
    torch.testing.assert_close(state["w"], _state(1.0)["w"])
    assert ck._warmup.done.wait(60)
    pool = ck._pool
    assert pool.file_backed and pool.capacity_bytes == capacity
    assert pool.reused_bytes == capacity  # every page was left allocated by the killed run
    assert pool.touched_bytes == capacity  # resident: nothing for the warm-up to fault in
    assert os.stat(shm_dir / ARENA).st_ino == left.st_ino
    ck.save(2, _state(2.0)).wait()
    ck.close()
    assert not (shm_dir / "staging").exists()  # a clean close leaves no arena
    got = _state(0.0)
    with flashckpt.Checkpointer(root, memory_tier=shm_dir) as again:
        assert again.restore(got) == 2
    torch.testing.assert_close(got["w"], _state(2.0)["w"])


def test_stale_bytes_in_the_arena_file_never_reach_a_checkpoint(
    tmp_path: Path, shm_dir: Path
) -> None:
    tier = _tier(shm_dir)
    (tier / "staging").mkdir(mode=0o700)
    (tier / ARENA).write_bytes(os.urandom(40 * MiB))  # a killed run's leftovers, or anything
    root = tmp_path / "root"
    with flashckpt.Checkpointer(root, memory_tier=tier, async_save=True, compression="zstd") as ck:
        ck.save(1, _state(3.0)).wait()
        assert ck._pool.file_backed
    got = _state(0.0)
    with flashckpt.Checkpointer(root) as disk:  # the copy promoted from the staged bytes
        assert disk.restore(got) == 1
    torch.testing.assert_close(got["w"], _state(3.0)["w"])


def test_a_memory_tier_on_a_disk_keeps_the_arena_anonymous(tmp_path: Path) -> None:
    mem = tmp_path / "mem"  # not tmpfs: a file arena would be written back to the disk
    with flashckpt.Checkpointer(
        tmp_path / "root", memory_tier=mem, async_save=True, compression="zstd"
    ) as ck:
        ck.save(1, _state(1.0)).wait()
        assert ck._pool.capacity_bytes > 0 and not ck._pool.file_backed
    assert not (mem / "staging").exists()


def test_an_earlier_larger_arena_is_shrunk_to_what_is_needed(shm_dir: Path) -> None:
    tier = _tier(shm_dir)
    first = ArenaFile(tier, "writer").map(4 * MiB)
    assert first is not None and first.reused_bytes == 0
    del first
    got = ArenaFile(tier, "writer").map(1 * MiB)
    assert got is not None and got.reused_bytes == 1 * MiB
    assert os.stat(tier / ARENA).st_size == 1 * MiB
    assert got.tensor.numel() == 1 * MiB and got.tensor.data_ptr() % 4096 == 0


def test_a_symlink_in_place_of_the_arena_is_not_followed(tmp_path: Path, shm_dir: Path) -> None:
    tier = _tier(shm_dir)
    (tier / "staging").mkdir(mode=0o700)
    victim = tmp_path / "victim"
    victim.write_bytes(b"keep me")
    (tier / ARENA).symlink_to(victim)
    assert ArenaFile(tier, "writer").map(1 * MiB) is None
    assert victim.read_bytes() == b"keep me"


def test_a_symlinked_staging_directory_is_not_followed(tmp_path: Path, shm_dir: Path) -> None:
    tier = _tier(shm_dir)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tier / "staging").symlink_to(elsewhere, target_is_directory=True)
    assert ArenaFile(tier, "writer").map(1 * MiB) is None
    ArenaFile(tier, "writer").remove()  # close(): unlinks nothing through the link either
    assert list(elsewhere.iterdir()) == []
    assert (tier / "staging").is_symlink()


def test_a_fifo_in_place_of_the_arena_does_not_hang_and_is_left_alone(shm_dir: Path) -> None:
    tier = _tier(shm_dir)
    (tier / "staging").mkdir(mode=0o700)
    os.mkfifo(tier / ARENA)
    assert ArenaFile(tier, "writer").map(1 * MiB) is None  # (a blocking open would hang here)
    assert (tier / ARENA).exists()


def test_a_hard_link_to_other_bytes_is_not_truncated(shm_dir: Path) -> None:
    tier = _tier(shm_dir)
    (tier / "staging").mkdir(mode=0o700)
    other = tier / "other.bin"
    other.write_bytes(b"\x07" * (2 * MiB))
    os.link(other, tier / ARENA)
    assert ArenaFile(tier, "writer").map(1 * MiB) is None  # would have shrunk it to 1 MiB
    assert other.read_bytes() == b"\x07" * (2 * MiB)


def test_an_arena_file_of_another_user_is_left_alone(
    shm_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tier = _tier(shm_dir)
    (tier / "staging").mkdir(mode=0o700)
    (tier / ARENA).write_bytes(b"theirs")
    owner = os.stat(tier / ARENA).st_uid
    monkeypatch.setattr(os, "geteuid", lambda: owner + 1)  # we are someone else now
    assert ArenaFile(tier, "writer").map(1 * MiB) is None
    monkeypatch.undo()
    assert (tier / ARENA).read_bytes() == b"theirs"


def test_a_full_tmpfs_falls_back_to_anonymous_memory_and_leaves_nothing_allocated(
    tmp_path: Path, shm_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tier = _tier(shm_dir)

    def full(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    with flashckpt.Checkpointer(
        tmp_path / "root", memory_tier=tier, async_save=True, compression="zstd"
    ) as ck:
        ck.save(1, _state(1.0)).wait()  # still saved, from anonymous staging memory
        assert ck._pool.capacity_bytes > 0 and not ck._pool.file_backed
        assert os.stat(tier / ARENA).st_size == 0  # nothing half-allocated kept in the tier
        assert 1 in ck.steps()


def test_a_tight_tmpfs_keeps_its_room_for_checkpoints(
    shm_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tier = _tier(shm_dir)
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(arena.shutil, "disk_usage", lambda p: usage(64 * MiB, 0, 3 * MiB))
    assert ArenaFile(tier, "writer").map(1 * MiB) is None  # 3 MiB free < the arena + 3 more
    monkeypatch.setattr(arena.shutil, "disk_usage", lambda p: usage(64 * MiB, 0, 4 * MiB))
    assert ArenaFile(tier, "writer").map(1 * MiB) is not None


def test_a_pinned_arena_never_uses_the_file(shm_dir: Path) -> None:
    tier = _tier(shm_dir)
    pool = StagingPool(budget_bytes=8 * MiB, chunk_bytes=1 * MiB, backing=ArenaFile(tier, "w"))
    pool.reserve(needed_bytes=2 * MiB, pin=True)  # CUDA: cudaHostAlloc; CPU build: pageable
    assert pool.capacity_bytes >= 2 * MiB and not pool.file_backed
    assert not (tier / "staging").exists()
    pool.close()


def test_an_arena_file_writable_by_others_is_left_alone(shm_dir: Path) -> None:
    tier = _tier(shm_dir)
    (tier / "staging").mkdir(mode=0o700)
    (tier / ARENA).write_bytes(b"x" * 100)
    os.chmod(tier / ARENA, 0o666)  # anyone could have written what a save would then stage
    assert ArenaFile(tier, "writer").map(1 * MiB) is None
    assert (tier / ARENA).read_bytes() == b"x" * 100


def test_a_failure_to_give_back_a_half_allocated_arena_still_falls_back(
    shm_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The ENOSPC path truncates the file; a failure there must not reach the save."""
    tier = _tier(shm_dir)

    def full(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    def refuse(fd: int, length: int) -> None:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "posix_fallocate", full)
    monkeypatch.setattr(os, "ftruncate", refuse)
    assert ArenaFile(tier, "writer").map(1 * MiB) is None


RANK_WRITER = textwrap.dedent(
    """
    import os, signal, sys
    from flashckpt.engine.tiers.arena import ArenaFile
    from flashckpt.store.lock import WriterLock
    tier, name, end = sys.argv[1], sys.argv[2], sys.argv[3]
    WriterLock(tier, name=name).acquire()  # the memory tier's writer lock of that rank
    assert ArenaFile(__import__("pathlib").Path(tier), name).map(1 << 20) is not None
    print("mapped", flush=True)
    if end == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    sys.stdin.read()  # "live": holds its lock until the test closes stdin
    """
)


def test_arenas_of_killed_writers_with_other_lock_names_are_swept(
    tmp_path: Path, shm_dir: Path
) -> None:
    """Regression: a killed single process (``writer``) then a torchrun job (``rank-<r>``), or
    8 ranks then 4, left the killed writers' arenas in /dev/shm for good: the next writers
    only ever map their own names. Whoever takes an arena now sweeps those nobody's lock
    holds; a live writer's arena (another rank of the node) stays."""
    tier = _tier(shm_dir)
    for name in ("writer", "rank-5", "rank-7"):  # killed with SIGKILL, arenas left behind
        res = subprocess.run(
            [sys.executable, "-c", RANK_WRITER, str(tier), name, "kill"],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert res.returncode == -signal.SIGKILL and "mapped" in res.stdout, res.stderr
    live = subprocess.Popen(
        [sys.executable, "-c", RANK_WRITER, str(tier), "rank-1", "live"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert live.stdout is not None and live.stdout.readline().strip() == "mapped"
        (tier / "staging" / "notes.txt").write_text("not an arena")  # never touched
        left = sorted(p.name for p in (tier / "staging").iterdir())
        assert left == ["notes.txt", "rank-1.arena", "rank-5.arena", "rank-7.arena",
                        "writer.arena"]  # fmt: skip
        with flashckpt.Checkpointer(
            tmp_path / "root", memory_tier=tier, async_save=True, compression="zstd"
        ) as ck:  # a new single-process writer: its own arena is "writer"
            ck.save(1, _state(1.0)).wait()
            assert ck._pool.file_backed
            left = sorted(p.name for p in (tier / "staging").iterdir())
            assert left == ["notes.txt", "rank-1.arena", "writer.arena"], left
    finally:
        assert live.stdin is not None
        live.stdin.close()
        live.wait(60)
    assert sorted(p.name for p in (tier / "staging").iterdir()) == ["notes.txt", "rank-1.arena"]
    with flashckpt.Checkpointer(
        tmp_path / "root", memory_tier=tier, async_save=True, compression="zstd"
    ) as ck:  # rank-1's writer ended without close(): swept by the next start
        ck.save(2, _state(2.0)).wait()
    assert sorted(p.name for p in (tier / "staging").iterdir()) == ["notes.txt"]
    assert not [p for p in (tier / "chunks").rglob("*") if p.is_file()]  # emptied at close
