"""Whole-path trust, as a matrix: from a trusted anchor (the root as given, /dev/shm itself) every
ancestor of what flashckpt creates or writes is checked (not a symlink; this user's or root's;
not writable by others unless sticky); files it writes into are refused when they have more than
one link; the quarantine directory is never followed.

Tests run as root, so "another user" is made with os.chown to a nobody uid."""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import uuid
from pathlib import Path

import pytest

import flashckpt
from flashckpt.cli import main
from flashckpt.journal import Journal
from flashckpt.store.files import safeopen
from hostile.util import small_state

pytestmark = pytest.mark.timeout(120)
NOBODY = 65534
SHM = Path("/dev/shm")


@pytest.fixture
def shm_name():
    """A fresh name directly in the real /dev/shm, removed afterwards."""
    p = SHM / f"flashckpt-test-{uuid.uuid4().hex[:12]}"
    yield p
    if p.is_symlink() or p.is_file():
        p.unlink()
    elif p.exists():
        shutil.rmtree(p)


def _nothing_created(path: Path) -> None:
    assert not path.exists() or not list(path.iterdir()), f"something was created in {path}"


# -- ancestors of a memory tier ----------------------------------------------------------------
def test_symlinked_dev_shm_parent_is_refused(tmp_path, shm_name):
    """With /dev/shm/X a symlink planted by another user, the tier was created where it
    pointed."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    shm_name.symlink_to(elsewhere)
    with pytest.raises(flashckpt.ConfigError, match="symlink"):
        flashckpt.Checkpointer(tmp_path / "root", memory_tier=shm_name / "run")
    _nothing_created(elsewhere)


@pytest.mark.parametrize("where", ["dev-shm", "tmp"])
def test_world_writable_parent_owned_by_another_user_is_refused(tmp_path, shm_name, where):
    """Anyone could swap the tier inside such a parent mid-run (locks/root.lock was written
    through a swapped-in link)."""
    parent = shm_name if where == "dev-shm" else tmp_path / "shared"
    parent.mkdir()
    os.chmod(parent, 0o777)
    os.chown(parent, NOBODY, NOBODY)
    with pytest.raises(flashckpt.ConfigError, match=r"writable by others|owned by uid"):
        flashckpt.Checkpointer(tmp_path / "root", memory_tier=parent / "run")
    _nothing_created(parent)


def test_parent_owned_by_another_user_is_refused_even_when_not_writable(tmp_path):
    parent = tmp_path / "theirs"
    parent.mkdir(mode=0o755)
    os.chown(parent, NOBODY, NOBODY)
    with pytest.raises(flashckpt.ConfigError, match=f"owned by uid {NOBODY}"):
        flashckpt.Checkpointer(tmp_path / "root", memory_tier=parent / "a" / "run")


def test_sticky_world_writable_parent_like_tmp_is_fine(tmp_path):
    parent = tmp_path / "sticky"
    parent.mkdir()
    os.chmod(parent, 0o1777)
    with flashckpt.Checkpointer(tmp_path / "root", memory_tier=parent / "x" / "run") as ckpt:
        ckpt.save(1, small_state(1.0))
    assert (parent / "x" / "run" / "steps").is_dir()
    assert os.stat(parent / "x").st_mode & 0o777 == 0o700  # missing parents are created 0700


def test_a_tier_in_dev_shm_itself_works(tmp_path, shm_name):
    with flashckpt.Checkpointer(tmp_path / "root", memory_tier=shm_name / "run") as ckpt:
        ckpt.save(1, small_state(1.0))
        assert ckpt.steps() == [1]


@pytest.mark.parametrize("sub", ["steps", "chunks", "locks"])
def test_directory_below_the_root_owned_by_another_user_is_refused(tmp_path, sub):
    root = tmp_path / "root"
    with flashckpt.Checkpointer(root) as ckpt:
        ckpt.save(1, small_state(1.0))
    os.chmod(root / sub, 0o777)
    os.chown(root / sub, NOBODY, NOBODY)
    with pytest.raises(flashckpt.FlashCkptError, match="refusing"):
        with flashckpt.Checkpointer(root) as ckpt:
            ckpt.save(2, small_state(2.0))


# -- hard links --------------------------------------------------------------------------------
@pytest.mark.parametrize("rel", ["locks/writer.lock", "locks/running.json"])
def test_hard_linked_lock_and_marker_are_never_written_through(tmp_path, rel):
    root = tmp_path / "root"
    with flashckpt.Checkpointer(root) as ckpt:
        ckpt.save(1, small_state(1.0))
    victim = tmp_path / "victim.txt"
    victim.write_bytes(b"precious\n")
    target = root / rel
    target.parent.mkdir(exist_ok=True)
    if target.exists():
        target.unlink()
    os.link(victim, target)
    with pytest.raises(flashckpt.FlashCkptError, match="links"):
        with flashckpt.Checkpointer(root) as ckpt:
            ckpt.save(2, small_state(2.0))
    assert victim.read_bytes() == b"precious\n"


def test_hard_linked_journal_is_never_appended_to(tmp_path, caplog):
    root = tmp_path / "root"
    root.mkdir()
    victim = tmp_path / "victim.txt"
    victim.write_bytes(b"precious\n")
    os.link(victim, root / "journal.jsonl")
    Journal(root / "journal.jsonl").append("run_start")
    with flashckpt.Checkpointer(root) as ckpt:
        ckpt.save(1, small_state(1.0))
    assert victim.read_bytes() == b"precious\n"
    assert "links" in caplog.text


def test_gateway_refuses_a_write_open_of_a_multiply_linked_file_before_truncating(tmp_path):
    (tmp_path / "a").write_bytes(b"keep")
    os.link(tmp_path / "a", tmp_path / "b")
    with pytest.raises(flashckpt.StorageError, match="2 links"):
        safeopen.open_nofollow(tmp_path, "b", os.O_WRONLY | os.O_TRUNC)
    assert (tmp_path / "a").read_bytes() == b"keep"
    fd = safeopen.open_nofollow(tmp_path, "b", os.O_RDONLY)  # reading is fine
    os.close(fd)


# -- quarantine --------------------------------------------------------------------------------
@pytest.mark.parametrize("how", ["verify", "restore"])
def test_quarantine_symlink_is_never_followed(tmp_path, how):
    root = tmp_path / "root"
    with flashckpt.Checkpointer(root) as ckpt:
        ckpt.save(1, small_state(1.0))
        ckpt.save(2, small_state(2.0))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (root / "quarantine").symlink_to(elsewhere)
    newest = sorted((root / "chunks").rglob("*"))
    chunk = next(p for p in newest if p.is_file())
    chunk.write_bytes(b"\xff" * chunk.stat().st_size)  # damage it
    if how == "verify":
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            assert main(["verify", str(root)]) == 1
    else:
        with pytest.warns(UserWarning), flashckpt.Checkpointer(root) as ckpt:
            ckpt.restore(small_state())
    _nothing_created(elsewhere)
    assert (root / "quarantine").is_symlink()


def test_quarantine_moves_into_a_real_directory(tmp_path):
    root = tmp_path / "root"
    with flashckpt.Checkpointer(root) as ckpt:
        ckpt.save(1, small_state(1.0))
    chunk = next(p for p in (root / "chunks").rglob("*") if p.is_file())
    chunk.write_bytes(b"\xff" * chunk.stat().st_size)
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        assert main(["verify", str(root)]) == 1
    moved = list((root / "quarantine").iterdir())
    assert len(moved) == 1 and moved[0].name.startswith(chunk.name)
    assert os.stat(root / "quarantine").st_mode & 0o777 == 0o700


def test_reading_a_root_whose_directories_belong_to_another_user_still_works(tmp_path):
    """Trust is checked for what flashckpt creates or writes: an evaluation job may read a
    trainer's root (read-only restore, ls, verify) even when its directories are not its own."""
    root = tmp_path / "root"
    with flashckpt.Checkpointer(root) as ckpt:
        ckpt.save(1, small_state(1.0))
    for sub in ("steps", "chunks"):
        os.chown(root / sub, NOBODY, NOBODY)
    assert flashckpt.restore(root, small_state()) == 1
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        assert main(["verify", str(root)]) == 0
