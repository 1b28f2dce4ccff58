"""Nothing outside the root: planted symlinks, FIFOs and directories at the paths flashckpt
touches. Each case asserts a FlashCkptError or a skip of the bad item, the fallback to the older
valid step, no hang (pytest-timeout; CLI runs in subprocesses with a timeout), and that no file
outside the root was changed or deleted."""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import flashckpt
from flashckpt.cli import main
from flashckpt.store.files import safeopen
from flashckpt.store.files.backend import LocalBackend
from flashckpt.store.gc import collect_garbage
from flashckpt.store.store import CheckpointStore
from hostile.util import manifest_path, restore_newest, small_state

pytestmark = pytest.mark.timeout(60)


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    """Run the CLI in-process (pytest-timeout bounds a hang); an uncaught exception fails."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(list(args))
    return subprocess.CompletedProcess(args, rc, out.getvalue(), err.getvalue())


def _cli_subprocess(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(Path(flashckpt.__file__).parents[1])}
    return subprocess.run(
        [sys.executable, "-m", "flashckpt.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


def _a_chunk(root: Path) -> Path:
    return next(p for p in (root / "chunks").rglob("*") if p.is_file())


# -- writes through symlinks --------------------------------------------------------------------
def test_symlinked_journal_is_not_followed(two_steps, outside):
    root = two_steps()
    (root / "journal.jsonl").unlink()
    (root / "journal.jsonl").symlink_to(outside.path / "victim.txt")
    with flashckpt.Checkpointer(root) as ckpt:
        ckpt.save(3, small_state(3.0))  # journaling fails quietly, the save does not
    outside.check()
    assert restore_newest(root) == 3


def test_symlinked_run_marker_is_replaced_not_followed(two_steps, outside):
    root = two_steps()
    (root / "locks" / "running.json").symlink_to(outside.path / "victim.txt")
    with flashckpt.Checkpointer(root) as ckpt:
        ckpt.save(3, small_state(3.0))
    outside.check()
    assert not (root / "locks" / "running.json").exists()  # removed by close(), link and all


def test_symlinked_steps_dir_refuses_to_commit(tmp_path, outside):
    root = tmp_path / "root"
    root.mkdir()
    (root / "steps").symlink_to(outside.path / "sub")
    with pytest.raises(flashckpt.FlashCkptError):
        with flashckpt.Checkpointer(root) as ckpt:
            ckpt.save(1, small_state(1.0)).durable.result()
    outside.check()


def test_symlinked_manifest_is_replaced_not_written_through(two_steps, outside):
    root = two_steps()
    m = manifest_path(root, 3)
    m.symlink_to(outside.path / "victim.txt")
    with flashckpt.Checkpointer(root) as ckpt:
        ckpt.save(3, small_state(3.0))
    outside.check()
    assert not m.is_symlink() and restore_newest(root) == 3


def test_gc_never_descends_into_a_symlinked_chunk_dir(tmp_path):
    other = tmp_path / "other"
    with flashckpt.Checkpointer(other) as ckpt:
        ckpt.save(1, small_state(1.0))
    theirs = _a_chunk(other)
    root = tmp_path / "root"
    (root / "steps").mkdir(parents=True)
    (root / "chunks").mkdir()
    (root / "chunks" / theirs.parent.name).symlink_to(theirs.parent)
    assert _cli("gc", str(root)).returncode == 0
    assert theirs.exists()
    store = CheckpointStore(LocalBackend(root, create=False))
    collect_garbage(store)
    assert theirs.exists() and restore_newest(other) == 1


def test_backend_delete_through_a_symlinked_dir_is_refused(tmp_path, outside):
    backend = LocalBackend(tmp_path / "root")
    (tmp_path / "root" / "chunks").mkdir()
    (tmp_path / "root" / "chunks" / "ab").symlink_to(outside.path / "sub")
    with pytest.raises(flashckpt.StorageError, match="symlink"):
        backend.delete("chunks/ab/victim2.bin")
    assert backend.list("chunks") == []  # the link is not listed, so nothing descends into it
    outside.check()


# -- FIFOs and other non-regular files --------------------------------------------------------
def test_fifo_manifest_is_damage_and_restore_falls_back(two_steps):
    root = two_steps()
    manifest_path(root, 2).unlink()
    os.mkfifo(manifest_path(root, 2))
    with pytest.warns(UserWarning, match="step 2"):
        assert restore_newest(root) == 1
    with flashckpt.Checkpointer(root) as ckpt, pytest.raises(flashckpt.CorruptCheckpointError):
        ckpt.restore(small_state(), step=2)


def test_fifo_manifest_does_not_hang_the_cli(two_steps):
    root = two_steps()
    manifest_path(root, 2).unlink()
    os.mkfifo(manifest_path(root, 2))
    ls = _cli_subprocess("ls", str(root))  # a real process: a hang here is a timeout
    assert ls.returncode == 0 and "DAMAGED" in ls.stdout
    assert _cli("verify", str(root)).returncode == 1
    inspect = _cli("inspect", str(root), "--step", "2")
    assert inspect.returncode == 2 and "FIFO" in inspect.stderr
    export = _cli("export", str(root), str(root.parent / "out.safetensors"), "--step", "2")
    assert export.returncode == 2 and "Traceback" not in export.stderr


def test_fifo_chunk_is_damage_for_verify_export_and_restore(two_steps):
    root = two_steps()
    with flashckpt.Checkpointer(root) as ckpt:
        ckpt.save(3, small_state(3.0))
    chunk = next(
        p
        for p in (root / "chunks").rglob("*")
        if p.is_file()
        and p.name.split(".")[0] in manifest_path(root, 3).read_text()
        and p.name.split(".")[0] not in manifest_path(root, 2).read_text()
    )
    chunk.unlink()
    os.mkfifo(chunk)
    verify = _cli("verify", str(root), "--step", "3")
    assert verify.returncode == 1 and "DAMAGED" in verify.stdout + verify.stderr
    export = _cli("export", str(root), str(root.parent / "o.safetensors"), "--step", "3")
    assert export.returncode == 2 and "Traceback" not in export.stderr
    with pytest.warns(UserWarning, match="step 3"):
        assert restore_newest(root) == 2


def test_directory_in_place_of_a_manifest_is_damage(two_steps):
    root = two_steps()
    manifest_path(root, 2).unlink()
    manifest_path(root, 2).mkdir()
    with pytest.warns(UserWarning, match="step 2"):
        assert restore_newest(root) == 1


def test_open_nofollow_refuses_non_regular_files(tmp_path):
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(flashckpt.CorruptCheckpointError, match="FIFO"):
        safeopen.open_nofollow(tmp_path, "fifo", os.O_RDONLY)
    with pytest.raises(flashckpt.CorruptCheckpointError, match=r"FIFO|socket"):
        safeopen.open_nofollow(tmp_path, "fifo", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    (tmp_path / "d").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "d")
    with pytest.raises(flashckpt.StorageError, match="symlink"):
        safeopen.open_nofollow(tmp_path, "link/x", os.O_WRONLY | os.O_CREAT)
    assert not (tmp_path / "d" / "x").exists()


# -- the matrix: every path flashckpt touches x {symlink out, FIFO, directory} ------------------
_PATHS = [
    "journal.jsonl",
    "locks/running.json",
    "tiers.json",
    "root-id",
    "steps/000000000003.json",
    "steps/000000000002.json",
    "CHUNK_DIR",
    "CHUNK",
]


def _plant(root: Path, rel: str, kind: str, outside: Path) -> Path:
    if rel == "CHUNK":
        target = _a_chunk(root)
    elif rel == "CHUNK_DIR":
        target = _a_chunk(root).parent
    else:
        target = root / rel
    target.parent.mkdir(parents=True, exist_ok=True)
    if target.is_dir() and not target.is_symlink():
        for p in target.iterdir():
            p.unlink()
        target.rmdir()
    elif target.exists() or target.is_symlink():
        target.unlink()
    if kind == "symlink":
        target.symlink_to(outside / ("sub" if rel == "CHUNK_DIR" else "victim.txt"))
    elif kind == "fifo":
        os.mkfifo(target)
    else:
        target.mkdir()
    return target


@pytest.mark.parametrize("kind", ["symlink", "fifo", "dir"])
@pytest.mark.parametrize("rel", _PATHS)
def test_planted_entry_matrix(two_steps, outside, rel, kind):
    """A whole run over a root with one planted entry: open, restore, save, gc, close, verify.
    Either it works (the entry is skipped, replaced, or the step it damages is skipped) or a
    FlashCkptError says why; it never hangs and never touches a file outside the root."""
    root = two_steps()
    _plant(root, rel, kind, outside.path)
    restored: int | None = None
    try:
        with flashckpt.Checkpointer(root, keep=2) as ckpt:
            state = small_state()
            restored = ckpt.restore(state)
            if restored is not None:
                assert torch.equal(state["w"], torch.full((64,), float(restored)))
            ckpt.save(4, small_state(4.0))
    except flashckpt.FlashCkptError:
        pass
    outside.check()
    assert restored in (None, 1, 2)
    verify = _cli("verify", str(root))
    assert verify.returncode in (0, 1, 2) and "Traceback" not in verify.stderr
    gc = _cli("gc", str(root))  # 1: gc found a damaged manifest and deleted nothing
    assert gc.returncode in (0, 1, 2) and "Traceback" not in gc.stderr
    assert _cli("ls", str(root)).returncode in (0, 2)
    outside.check()


def test_symlinked_writer_lock_is_not_followed(two_steps, outside):
    root = two_steps()
    (root / "locks" / "writer.lock").unlink()
    (root / "locks" / "writer.lock").symlink_to(outside.path / "victim.txt")
    try:
        with flashckpt.Checkpointer(root) as ckpt:
            ckpt.save(3, small_state(3.0))
    except flashckpt.FlashCkptError:
        pass
    outside.check()


def test_symlinked_root_lock_is_not_followed(two_steps, outside):
    """locks/root.lock (writers shared, gc exclusive) is opened like the writer lock."""
    root = two_steps()
    lock = root / "locks" / "root.lock"
    lock.unlink(missing_ok=True)
    lock.symlink_to(outside.path / "victim.txt")
    try:
        with flashckpt.Checkpointer(root) as ckpt:
            ckpt.save(3, small_state(3.0))
    except flashckpt.FlashCkptError:
        pass
    outside.check()


def test_direct_io_probe_never_follows_a_planted_link(tmp_path, outside):
    import os

    from flashckpt.store.files import directio

    (tmp_path / f".direct-probe-{os.getpid()}").symlink_to(outside.path / "victim.txt")
    assert directio.supported(tmp_path) is False
    outside.check()
