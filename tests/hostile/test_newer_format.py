"""A manifest written by a newer flashckpt (a format version this one does not read) is not
damage. The regression: restore() skipped it as damaged ("skipping damaged checkpoint step 2"),
trained on from step 1, and the next save(2) replaced it: deleted a good checkpoint from every
tier. Now every path that meets it raises :class:`UnsupportedFormatError`, naming the version
and what to do, and leaves the step, its chunks and the live state as they were."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import flashckpt
from flashckpt.store.files.backend import LocalBackend
from flashckpt.store.gc import collect_garbage
from flashckpt.store.store import CheckpointStore
from hostile.util import manifest_path, small_state


def _root_with_a_newer_step(tmp_path: Path, **kw: object) -> tuple[Path, bytes]:
    root = tmp_path / "root"
    with flashckpt.Checkpointer(root, **kw) as ckpt:  # type: ignore[arg-type]
        ckpt.save(1, small_state(1.0))
        ckpt.save(2, small_state(2.0))
    path = manifest_path(root, 2)
    doc = json.loads(path.read_text())
    doc["version"] = 3
    path.write_text(json.dumps(doc))
    return root, path.read_bytes()


def _chunks(root: Path) -> set[str]:
    return {p.name for p in (root / "chunks").rglob("*") if p.is_file()}


def test_restore_raises_and_never_falls_back_to_an_older_step(tmp_path: Path) -> None:
    root, newer = _root_with_a_newer_step(tmp_path)
    chunks = _chunks(root)
    state = small_state(-1.0)
    with flashckpt.Checkpointer(root) as ckpt:
        with pytest.raises(flashckpt.UnsupportedFormatError, match="version 3") as err:
            ckpt.restore(state)
        assert "upgrade flashckpt" in str(err.value) and err.value.version == 3
        assert not isinstance(err.value, flashckpt.CorruptCheckpointError)
        assert torch.equal(state["w"], torch.full((64,), -1.0))  # type: ignore[arg-type]
        with pytest.raises(flashckpt.ConfigError, match="already committed"):
            ckpt.save(2, small_state(9.0))  # a step this run never judged damaged
        assert ckpt.restore(state, step=1) == 1  # an older step, asked for by number
    assert manifest_path(root, 2).read_bytes() == newer
    assert _chunks(root) == chunks  # close ran retention and gc: step 2's chunks are live


def test_the_read_only_restore_and_gc_leave_it_too(tmp_path: Path) -> None:
    root, newer = _root_with_a_newer_step(tmp_path)
    chunks = _chunks(root)
    with pytest.raises(flashckpt.UnsupportedFormatError, match="newer flashckpt"):
        flashckpt.restore(root, small_state())
    res = collect_garbage(CheckpointStore(LocalBackend(root, create=False)), full=True)
    assert res.skipped and "newer flashckpt" in res.skipped and not res.damaged  # not damage
    assert _chunks(root) == chunks and manifest_path(root, 2).read_bytes() == newer


def test_a_newer_copy_in_the_memory_tier_is_not_passed_over_for_the_disk(
    tmp_path: Path,
) -> None:
    """The memory tier's copy is tried first: a newer format there raises; it is not taken for
    a damaged copy whose disk twin restores instead."""
    mem = tmp_path / "shm"
    root = tmp_path / "root"
    with flashckpt.Checkpointer(root, memory_tier=mem, keep_memory_after_close=True) as ckpt:
        ckpt.save(1, small_state(1.0))
        ckpt.wait_promoted()
    (path,) = [p for p in mem.rglob("000000000001.json")]
    doc = json.loads(path.read_text())
    doc["version"] = 7
    path.write_text(json.dumps(doc))
    assert manifest_path(root, 1).exists()  # the disk copy, version 2
    with flashckpt.Checkpointer(root, memory_tier=mem, keep_memory_after_close=True) as ckpt:
        with pytest.raises(flashckpt.UnsupportedFormatError, match="version 7"):
            ckpt.restore(small_state())


def _dist_restore(rank: int, world: int, root: str) -> dict[str, object]:
    state = small_state(-1.0)
    with flashckpt.Checkpointer(root, dist_timeout_s=30) as ckpt:
        try:
            ckpt.restore(state)
        except flashckpt.DistributedError as exc:
            return {"error": str(exc), "w": float(state["w"][0])}  # type: ignore[index]
    return {"error": None}


def test_every_rank_of_a_distributed_restore_raises(tmp_path: Path) -> None:
    """On 2 gloo ranks the newer step is not a damaged candidate to skip together: every rank
    raises the same DistributedError, naming the version, and loads nothing."""
    from distributed.conftest import run_ranks

    root, newer = _root_with_a_newer_step(tmp_path)
    results = run_ranks(_dist_restore, 2, tmp_path / "ranks", str(root))
    for r in results:
        assert isinstance(r, dict) and r["error"], r
        assert "UnsupportedFormatError" in r["error"] and "version 3" in r["error"]
        assert r["w"] == -1.0
    assert manifest_path(root, 2).read_bytes() == newer
