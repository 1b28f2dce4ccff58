"""Restore is all or nothing from the caller's view; read-only restore (flashckpt.restore)
next to a running trainer and from a read-only root."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import textwrap
import time
import warnings

import pytest
import torch

import flashckpt

N = 3 * 16384  # three 64 KiB chunks per tensor


def _state(value: float) -> dict:
    return {"a": torch.full((N,), value), "b": torch.full((N,), -value)}


def _flip_one_chunk(root) -> None:
    """Flip a byte inside one chunk (size unchanged, so only reading finds it)."""
    chunks = sorted(p for p in (root / "chunks").rglob("*") if p.is_file())
    data = bytearray(chunks[-1].read_bytes())
    data[100] ^= 0xFF
    chunks[-1].write_bytes(bytes(data))


def test_only_checkpoint_damaged_raises_instead_of_returning_none(tmp_path):
    """It returned None after overwriting most live tensors: ``start = restore(state) or 0``
    then trained "from scratch" on half-loaded weights."""
    with flashckpt.Checkpointer(tmp_path, chunk_size="64KiB") as ck:
        ck.save(1, _state(1.0))
    _flip_one_chunk(tmp_path)
    live = _state(0.0)
    with flashckpt.Checkpointer(tmp_path) as ck:
        with pytest.warns(UserWarning, match="skipping damaged"):
            with pytest.raises(flashckpt.CorruptCheckpointError, match="partly overwritten"):
                ck.restore(live)


def test_no_checkpoint_returns_none_and_leaves_the_state(tmp_path):
    live = _state(5.0)
    with flashckpt.Checkpointer(tmp_path) as ck:
        assert ck.restore(live) is None
    assert torch.equal(live["a"], torch.full((N,), 5.0))


def _tree(root) -> dict:
    return {
        str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns)
        for p in sorted(root.rglob("*"))
    }


def test_read_only_restore_writes_nothing_and_works_on_a_read_only_root(tmp_path):
    src = tmp_path / "run"
    with flashckpt.Checkpointer(src, chunk_size="64KiB", keep=3) as ck:
        for step in (1, 2):
            ck.save(step, _state(float(step)))
    ro = tmp_path / "snapshot"
    shutil.copytree(src, ro)
    for p in [ro, *ro.rglob("*")]:
        p.chmod(p.stat().st_mode & ~(stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH))
    before = _tree(ro)
    live = _state(0.0)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert flashckpt.restore(ro, live) == 2
        assert torch.equal(live["b"], torch.full((N,), -2.0))
        assert flashckpt.restore(ro, live, step=1) == 1
        assert _tree(ro) == before  # no journal, no run marker, no lock file, no mkdir
    finally:
        for p in [ro, *ro.rglob("*")]:
            p.chmod(p.stat().st_mode | stat.S_IWUSR)
    missing = tmp_path / "nothing-here"
    assert flashckpt.restore(missing, live) is None and not missing.exists()


def test_read_only_restore_while_this_process_writes_the_root(tmp_path):
    with flashckpt.Checkpointer(tmp_path) as ck:
        ck.save(1, _state(1.0))
        live = _state(0.0)
        assert flashckpt.restore(tmp_path, live) == 1  # no writer lock taken
        ck.save(2, _state(2.0))
    assert torch.equal(live["a"], torch.full((N,), 1.0))


TRAINER = """
import os, time, torch, flashckpt
N = {n}
ck = flashckpt.Checkpointer({root!r}, keep=2, chunk_size="64KiB", memory_tier={mem!r})
step = 0
while not os.path.exists({stop!r}) and step < 5000:
    step += 1
    ck.save(step, {{"a": torch.full((N,), float(step)), "b": torch.full((N,), -float(step))}})
ck.close()
"""


def test_read_only_restore_while_another_process_trains_and_collects(tmp_path):
    """An eval process restores again and again while a trainer saves every step, retention
    keeps 2 and gc deletes the rest: never an error, never a damage warning, and always one
    whole step (not a mix of two)."""
    root, mem, stop = tmp_path / "run", tmp_path / "mem", tmp_path / "stop"
    code = textwrap.dedent(TRAINER.format(n=N, root=str(root), mem=str(mem), stop=str(stop)))
    trainer = subprocess.Popen([sys.executable, "-c", code], stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        while not (root / "tiers.json").exists() or not flashckpt.restore(root, _state(0.0)):
            assert trainer.poll() is None, trainer.stderr.read().decode() if trainer.stderr else ""
            assert time.monotonic() < deadline
            time.sleep(0.05)
        seen = set()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            for _ in range(40):
                live = _state(0.0)
                got = flashckpt.restore(root, live)
                assert got is not None
                assert torch.equal(live["a"], torch.full((N,), float(got)))
                assert torch.equal(live["b"], torch.full((N,), -float(got)))
                seen.add(got)
        assert len(seen) > 1  # the trainer moved on while we read
    finally:
        stop.touch()
        trainer.wait(120)
    assert trainer.returncode == 0, trainer.stderr.read().decode() if trainer.stderr else ""
    assert not os.path.exists(root / "locks" / "running.json")


def test_step_restore_found_damaged_can_be_saved_again_after_the_fallback(tmp_path):
    """restore() skips damaged step 2 and loads step 1; training then reaches step 2 again.
    That step is replaced in every tier (not refused as "already committed")."""
    from flashckpt.store.files.backend import LocalBackend
    from flashckpt.store.store import CheckpointStore, chunk_path

    with flashckpt.Checkpointer(tmp_path, chunk_size="64KiB") as ck:
        ck.save(1, _state(1.0))
        ck.save(2, _state(2.0))
    ref = CheckpointStore(LocalBackend(tmp_path)).load_manifest(2).chunks[0]
    path = tmp_path / chunk_path(ref.hash, ref.codec)
    data = bytearray(path.read_bytes())
    data[10] ^= 0xFF
    path.write_bytes(bytes(data))
    live = _state(0.0)
    with flashckpt.Checkpointer(tmp_path, chunk_size="64KiB") as ck:
        with pytest.warns(UserWarning, match="skipping damaged checkpoint step 2"):
            assert ck.restore(live) == 1
        with pytest.raises(flashckpt.ConfigError, match="step 1 is already committed"):
            ck.save(1, live)
        ck.save(2, _state(2.5))
    out = _state(0.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert flashckpt.restore(tmp_path, out) == 2
    assert torch.equal(out["a"], torch.full((N,), 2.5))


def test_newest_step_deleted_while_read_falls_back_without_calling_it_damaged() -> None:
    """A step that retention deleted while it was being read (TierSet.restore raises
    NoCheckpointError "not damage") is skipped: the next older step loads, no damage warning,
    and the step is not recorded as damaged (it may not be re-saved as a replacement)."""
    import warnings as _warnings

    from flashckpt.engine.restore.load import Attempt, restore_newest
    from flashckpt.errors import NoCheckpointError

    loaded: list[int] = []

    def across(step: int, tiers: list[str], load: object) -> None:
        if step == 7:
            raise NoCheckpointError("step 7 was deleted by retention while it was read")
        loaded.append(step)

    attempt = Attempt()
    with _warnings.catch_warnings():
        _warnings.simplefilter("error")
        got = restore_newest(
            {5: ["memory"], 7: ["memory"]}, None, lambda s, t: None, across, attempt
        )
    assert got == 5 and loaded == [5]
    assert attempt.damaged == set()


def test_regression_an_eio_at_restore_is_not_damage_and_never_lets_a_save_delete_the_step(
    tmp_path, monkeypatch
):
    """Torture seed 154: an EIO while a restore checked step 2's chunks called the step damaged,
    so the next save(2) deleted its intact copy first (``damaged_step_replaced``), and when that
    save failed the step was gone. A device error says nothing about the bytes: the step is
    skipped for now, stays as it is, and restores once the device answers again."""
    import errno

    from flashckpt.errors import StorageError
    from flashckpt.store.files.backend import LocalBackend

    with flashckpt.Checkpointer(tmp_path, chunk_size="64KiB") as ck:
        ck.save(1, _state(1.0))
        ck.save(2, _state(2.0))
    real = LocalBackend.size

    def flaky(self, path):
        if path.startswith("chunks/"):
            err = StorageError(f"could not stat {path}: Input/output error")
            err.errno = errno.EIO
            raise err
        return real(self, path)

    target = _state(0.0)
    with flashckpt.Checkpointer(tmp_path, chunk_size="64KiB") as ck:
        monkeypatch.setattr(LocalBackend, "size", flaky)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            assert ck.restore(target) is None  # no step readable now, and none was touched
        monkeypatch.setattr(LocalBackend, "size", real)
        assert torch.equal(target["a"], torch.zeros(N)), "nothing was loaded"
        with pytest.raises(flashckpt.ConfigError, match="already committed"):
            ck.save(2, _state(9.0))  # an intact step is never replaced
    back = _state(0.0)
    with flashckpt.Checkpointer(tmp_path, chunk_size="64KiB") as ck:
        assert ck.restore(back) == 2
    assert torch.equal(back["a"], torch.full((N,), 2.0))
