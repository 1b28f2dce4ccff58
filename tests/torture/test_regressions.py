"""Named regression tests for the bugs the torture harness found.

Each reproduces one finding deterministically through the public API (faults come from the
harness's fault layer) and fails without its fix.
``xfail(strict=True)``: remove the mark once the fix is merged (the test must then pass).
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torture_faults import FaultPlan, install
from torture_kill import ForkServer, alive
from torture_oracle import disk_steps, manifest_path, temp_files

import flashckpt
from flashckpt.cli import main as cli_main
from flashckpt.errors import StorageError
from flashckpt.store.files.backend import LocalBackend

N = 8192  # 32 KiB of float32: two 16 KiB chunks


def _eio(path: str) -> StorageError:
    err = StorageError(f"could not read {path}: Input/output error (injected)")
    err.errno = errno.EIO
    return err


def _state(v: float) -> dict[str, Any]:
    return {"w": torch.arange(N, dtype=torch.float32) + v, "meta": {"v": v}}


def _target() -> dict[str, Any]:
    return {"w": torch.full((N,), -7.0), "meta": None}


def _chunks(root: Path, step: int) -> list[Path]:
    doc = json.loads((root / manifest_path(step)).read_bytes())
    return [root / "chunks" / c[0][:2] / c[0] for c in doc["chunks"]]


def _cli(*args: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    rc = cli_main(list(args))
    out = capsys.readouterr()
    return rc, out.out + out.err


def test_gc_keeps_the_chunks_of_a_step_whose_manifest_it_cannot_read(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Found by the simulation (close with EIO on reads: the final gc deleted the chunks of
    the step whose manifest read failed). One EIO must abort gc, not delete a valid step."""
    root = tmp_path / "ck"
    with flashckpt.Checkpointer(root, chunk_size="16KiB") as ckpt:
        ckpt.save(1, _state(1))
        ckpt.save(2, _state(2))

    def eio_on_step_1(method: str, backend: LocalBackend, path: str) -> None:
        if method == "read" and path == manifest_path(1):
            raise _eio(path)

    with install(FaultPlan(seed=0, scope=tmp_path)) as plan:
        plan.sabotage = eio_on_step_1
        _cli("gc", str(root), capsys=capsys)
    out = _target()
    with flashckpt.Checkpointer(root) as ckpt:
        assert ckpt.restore(out, step=1) == 1
    assert torch.equal(out["w"], _state(1)["w"])


def test_a_failed_save_does_not_delete_chunks_of_a_step_whose_manifest_it_cannot_read(
    tmp_path: Path,
) -> None:
    """Found by the simulation (a save failing under EIO on reads damaged an older step): the
    failed save's clean-up asks which chunks are still referenced, ignores the manifest it
    could not read, and deletes that older step's chunks (it rewrote them: incremental off)."""
    root = tmp_path / "ck"
    with flashckpt.Checkpointer(root, chunk_size="16KiB", incremental=False) as ckpt:
        ckpt.save(1, _state(1))

    def faults(method: str, backend: LocalBackend, path: str) -> None:
        if method == "put" and path == manifest_path(2):
            err = StorageError(f"could not write {path}: No space left on device (injected)")
            err.errno = errno.ENOSPC
            raise err
        if method == "read" and path == manifest_path(1):
            raise _eio(path)

    with flashckpt.Checkpointer(root, chunk_size="16KiB", incremental=False) as ckpt:
        with install(FaultPlan(seed=0, scope=tmp_path)) as plan:
            plan.sabotage = faults
            with pytest.raises(flashckpt.FlashCkptError):
                ckpt.save(2, _state(1))
        out = _target()
        assert ckpt.restore(out, step=1) == 1
    assert torch.equal(out["w"], _state(1)["w"])


def test_restore_does_not_return_none_after_overwriting_the_state(tmp_path: Path) -> None:
    """Found by the simulation (a rotted chunk, then restore()): with the only checkpoint
    damaged, restore() loaded the intact tensors into the live state and returned None."""
    root = tmp_path / "ck"
    state = {"a": torch.arange(8 * N, dtype=torch.float32), "b": torch.ones(N)}
    with flashckpt.Checkpointer(root, chunk_size="16KiB") as ckpt:
        ckpt.save(0, state)
    bad = _chunks(root, 0)[-1]
    data = bytearray(bad.read_bytes())
    data[100] ^= 0x10
    bad.write_bytes(bytes(data))
    live = {"a": torch.zeros(8 * N), "b": torch.zeros(N)}
    with flashckpt.Checkpointer(root) as ckpt:
        try:
            got = ckpt.restore(live)
        except flashckpt.CorruptCheckpointError:
            return  # raising says why: the documented outcome
    assert got is None
    assert not live["a"].any() and not live["b"].any(), "returned None after touching state"


def test_error_seen_through_durable_result_is_not_raised_again_by_the_next_save(
    tmp_path: Path,
) -> None:
    """Found by the simulation: after ``handle.durable.result()`` raised, the next save()
    raised the same error again (and did not save)."""
    root = tmp_path / "ck"
    failing = True

    def enospc(method: str, backend: LocalBackend, path: str) -> None:
        if failing and method == "put" and path.startswith("chunks/"):
            err = StorageError(f"could not write {path}: No space left on device (injected)")
            err.errno = errno.ENOSPC
            raise err

    with install(FaultPlan(seed=0, scope=tmp_path)) as plan:
        plan.sabotage = enospc
        with flashckpt.Checkpointer(root, async_save=True, chunk_size="16KiB") as ckpt:
            handle = ckpt.save(1, _state(1))
            with pytest.raises(flashckpt.FlashCkptError):
                handle.durable.result()
            failing = False
            ckpt.save(2, _state(2)).durable.result()
    assert disk_steps(root) == [2]


def test_a_save_whose_manifest_directory_sync_fails_leaves_no_manifest(tmp_path: Path) -> None:
    """Found by the simulation (EIO on ``sync_dirs``): commit() wrote the manifest, the fsync
    of ``steps/`` failed, save() raised, and the step stayed visible to restore()."""
    root = tmp_path / "ck"

    def eio_on_steps_sync(method: str, backend: LocalBackend, path: str) -> None:
        if method == "sync_dirs" and path == "steps":
            raise _eio("steps")

    with flashckpt.Checkpointer(root, chunk_size="16KiB", fsync=True) as ckpt:
        ckpt.save(1, _state(1))
        with install(FaultPlan(seed=0, scope=tmp_path)) as plan:
            plan.sabotage = eio_on_steps_sync
            with pytest.raises(flashckpt.FlashCkptError):
                ckpt.save(2, _state(2))
    assert disk_steps(root) == [1]


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_temporary_files_of_a_killed_save_are_collected(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Found by the kill trials: a save SIGKILLed mid-write leaves ``<chunk>.tmp-<pid>-<n>``
    files that no later run or ``flashckpt gc`` ever removes."""
    root = tmp_path / "ck"
    with flashckpt.Checkpointer(root, chunk_size="16KiB") as ckpt:
        ckpt.save(1, _state(1))
    pid = _dead_pid()
    old = time.time() - 86400
    for rel in (f"chunks/ab/{'ab' * 16}.tmp-{pid}-7", f"{manifest_path(5)}.tmp-{pid}-8"):
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(b"partial")
        os.utime(p, (old, old))
    with flashckpt.Checkpointer(root) as ckpt:  # the next clean run
        ckpt.save(2, _state(2))
    _cli("gc", str(root), capsys=capsys)
    assert temp_files(root) == []


def _retire_during_read(step: int) -> Any:
    """Sabotage: just before the reader reads ``step``'s manifest, retention deletes it."""

    def retire(method: str, backend: LocalBackend, path: str) -> None:
        if method == "read" and path == manifest_path(step):
            (backend.root / path).unlink(missing_ok=True)

    return retire


def test_verify_does_not_report_a_step_retired_while_it_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Found by the kill trials' concurrent reader: ``flashckpt verify`` racing retention
    printed ``DAMAGED ... no checkpoint for step N`` and exited 1 for a healthy root."""
    root = tmp_path / "ck"
    with flashckpt.Checkpointer(root, chunk_size="16KiB") as ckpt:
        ckpt.save(1, _state(1))
        ckpt.save(2, _state(2))
    with install(FaultPlan(seed=0, scope=tmp_path)) as plan:
        plan.sabotage = _retire_during_read(1)
        rc, text = _cli("verify", str(root), capsys=capsys)
    assert rc == 0 and "DAMAGED" not in text, text


def test_ls_does_not_report_a_step_retired_while_it_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Found by the kill trials' concurrent reader: ``flashckpt ls`` racing retention listed
    a step as DAMAGED (``no checkpoint for step N``)."""
    root = tmp_path / "ck"
    with flashckpt.Checkpointer(root, chunk_size="16KiB") as ckpt:
        ckpt.save(1, _state(1))
        ckpt.save(2, _state(2))
    with install(FaultPlan(seed=0, scope=tmp_path)) as plan:
        plan.sabotage = _retire_during_read(1)
        rc, text = _cli("ls", str(root), capsys=capsys)
    assert rc == 0 and "DAMAGED" not in text, text


def test_a_truncated_chunk_is_written_again_not_reused(tmp_path: Path) -> None:
    """The oracle's torn-write rule (a chunk torn before a save must not be reused by it):
    a truncated chunk on disk was reused by name, so the next step was unrestorable."""
    root = tmp_path / "ck"
    with flashckpt.Checkpointer(root, chunk_size="16KiB") as ckpt:
        ckpt.save(1, _state(1))
        torn = _chunks(root, 1)[0]
        torn.write_bytes(torn.read_bytes()[:1000])
        ckpt.save(2, _state(1))
        out = _target()
        assert ckpt.restore(out, step=2) == 2
    assert torch.equal(out["w"], _state(1)["w"])


def test_a_script_that_ends_with_an_async_save_in_flight_does_not_fail_it(
    tmp_path: Path, fork_server: ForkServer
) -> None:
    """Found by the kill trials' exit runs: a process whose script ends right after an async
    ``save()`` (no close()) failed that save with "cannot schedule new futures after
    shutdown". It must finish it, or journal that it was abandoned."""
    root, mem, out = tmp_path / "ck", tmp_path / "mem", tmp_path / "worker.log"
    # even seed: async; writes take 100 ms and a 256 MiB tensor takes a while to stage, so
    # the script ends while its last save is still staging
    pid = fork_server.spawn("worker", out, str(root), str(mem), "0", "3", "100", "256")
    deadline = time.monotonic() + 180
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not alive(pid), "the worker did not exit"
    events = [json.loads(ln) for ln in (root / "journal.jsonl").read_text().splitlines()]
    failed = [  # finishing it, or journaling it as abandoned, are both fine
        e
        for e in events
        if e.get("event") == "save_failed" and "after shutdown" in str(e.get("error"))
    ]
    assert not failed, failed
    assert "Traceback" not in out.read_text()
