"""Bounded before read: every reader checks a file's size (fstat, on the open descriptor) before
reading it, so a sparse file that claims gigabytes (a few bytes on disk) costs nothing, and JSON
parsers bound the number of objects and lists, not only the nesting depth.

Memory is measured with tracemalloc (every bytes object os.read returns is counted), not by
timing: each case would allocate gigabytes without the check."""

from __future__ import annotations

import contextlib
import io
import json
import os
import tracemalloc
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

import flashckpt
from flashckpt.cli import main
from flashckpt.integrations.hf_export import config_dict
from flashckpt.journal import read_events
from flashckpt.store.files import safeopen
from flashckpt.store.files.jsonfile import load_json
from flashckpt.store.gc import collect_garbage
from flashckpt.store.store import CheckpointStore
from hostile.util import manifest_path, small_state

pytestmark = pytest.mark.timeout(120)
SPARSE = 1_342_177_280  # 1.25 GiB apparent size, a few bytes on disk
PEAK_LIMIT = 96 << 20  # far below any of the files' claimed sizes


def sparse(path: Path, size: int = SPARSE, head: bytes = b"{") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        f.write(head)
        f.truncate(size)
    assert os.stat(path).st_blocks * 512 < 1 << 20  # really sparse
    return path


@contextlib.contextmanager
def bounded_memory(limit: int = PEAK_LIMIT) -> Iterator[None]:
    tracemalloc.start()
    try:
        yield
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < limit, f"peak {peak} bytes of Python memory: the file was read before its check"


def run_cli(argv: list[str]) -> tuple[int, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(argv)
    assert "Traceback" not in err.getvalue()
    return rc, out.getvalue() + err.getvalue()


@pytest.fixture
def root(tmp_path: Path) -> Path:
    r = tmp_path / "root"
    with flashckpt.Checkpointer(r) as ckpt:
        ckpt.save(1, small_state(1.0))
        ckpt.save(2, small_state(2.0))
    return r


# -- manifests ------------------------------------------------------------------------------
@pytest.mark.parametrize("command", ["ls", "verify", "inspect"])
def test_sparse_manifest_is_refused_before_it_is_read_by_the_cli(root, command):
    sparse(manifest_path(root, 3))
    with bounded_memory():
        rc, text = run_cli([command, str(root)] + (["--step", "3"] if command == "inspect" else []))
    assert rc in (0, 1, 2)
    if command == "verify":
        assert rc == 1 and "refusing to read it" in text
    if command == "inspect":
        assert rc == 2 and "refusing to read it" in text


def test_sparse_manifest_restore_falls_back_without_reading_it(root):
    sparse(manifest_path(root, 3))
    state = small_state()
    with bounded_memory(), pytest.warns(UserWarning):
        assert flashckpt.restore(root, state) == 2  # read-only restore
    with bounded_memory(), pytest.warns(UserWarning), flashckpt.Checkpointer(root) as ckpt:
        assert ckpt.restore(small_state()) == 2


def test_manifest_of_empty_objects_is_refused_before_it_is_parsed(root):
    # 48 MiB of {} (16M objects: 1.5 GB once parsed) in a syntactically valid manifest
    body = b'{"format":1,"step":3,"x":[' + b"{}," * (16 << 20) + b"{}]}"
    manifest_path(root, 3).write_bytes(body)
    with bounded_memory(len(body) + PEAK_LIMIT), pytest.warns(UserWarning):
        assert flashckpt.restore(root, small_state()) == 2
    with bounded_memory(len(body) + PEAK_LIMIT):
        rc, text = run_cli(["verify", str(root)])
    assert rc == 1 and "objects and lists" in text


def test_container_bound_refuses_lists_too_and_keeps_real_documents():
    with pytest.raises(flashckpt.FlashCkptError, match="objects and lists"):
        load_json(b"[" + b"[]," * 200_000 + b"[]]", where="x", max_bytes=1 << 30, max_depth=None)
    doc = {
        "tensors": {f"layer.{i}.weight": {"shape": [4, 4], "x": [[i, 0, 64]]} for i in range(5000)}
    }
    assert load_json(json.dumps(doc), where="x", max_bytes=1 << 30) == doc


# -- pins, gc and a save --------------------------------------------------------------------
def test_sparse_pin_stops_gc_and_a_save_without_being_read(root):
    sparse(root / "pins" / "planted.json")
    with bounded_memory():
        res = collect_garbage(CheckpointStore(flashckpt.store.files.backend.LocalBackend(root)))
    assert res.skipped is not None and res.chunks_deleted == 0
    with bounded_memory(), flashckpt.Checkpointer(root) as ckpt:
        ckpt.save(3, small_state(3.0))  # its gc is skipped (fail closed), the save lands
    assert (manifest_path(root, 3)).is_file()
    with bounded_memory():
        rc, _ = run_cli(["gc", str(root)])
    assert rc in (1, 2)


# -- files of a root's own ------------------------------------------------------------------
@pytest.mark.parametrize(
    "rel", ["locks/running.json", "locks/writer.lock", "tiers.json", "root-id", "journal.jsonl"]
)
def test_sparse_root_files_are_never_read_whole(root, rel):
    target = root / rel
    if target.exists():
        target.unlink()
    sparse(target, head=b"x")
    with bounded_memory():
        try:
            with flashckpt.Checkpointer(root) as ckpt:
                ckpt.restore(small_state())
        except flashckpt.FlashCkptError as exc:
            assert str(root) in str(exc)  # refused, naming the file
        rc, _ = run_cli(["ls", str(root)])
        assert rc in (0, 2)
        events = read_events(root)
        assert isinstance(events, list)


def test_sparse_journal_is_read_from_its_tail_only(tmp_path):
    p = tmp_path / "journal.jsonl"
    sparse(p, size=1 << 30, head=b"")
    with open(p, "ab") as f:
        f.write(b'\n{"t": 1.0, "event": "run_start", "pid": 1}\n')
    with bounded_memory():
        events = read_events(p)
    assert [e["event"] for e in events] == ["run_start"]


# -- files the user names -------------------------------------------------------------------
SPECIAL: dict[str, Callable[[Path], Path]] = {
    "fifo": lambda d: (os.mkfifo(d / "fifo"), d / "fifo")[1],
    "dev-zero": lambda d: Path("/dev/zero"),
    "dev-urandom": lambda d: Path("/dev/urandom"),
    "directory-without-config": lambda d: (d / "emptydir").mkdir() or d / "emptydir",
    "sparse": lambda d: sparse(d / "config.json"),
}


@pytest.mark.parametrize("kind", sorted(SPECIAL))
def test_hf_config_reader_refuses_special_and_oversized_files(tmp_path, kind):
    path = SPECIAL[kind](tmp_path)
    with bounded_memory(), pytest.raises(flashckpt.ConfigError):
        config_dict(path)


@pytest.mark.parametrize("kind", sorted(SPECIAL))
def test_export_hf_config_of_a_special_file_is_one_line_exit_2(tmp_path, kind):
    """These hung (a FIFO, /dev/urandom) or ended in a traceback (/dev/zero)."""
    root = tmp_path / "hfroot"
    with flashckpt.Checkpointer(root) as ckpt:
        ckpt.save(1, {"model": torch.nn.Linear(4, 4)})
    path = SPECIAL[kind](tmp_path)
    with bounded_memory():
        rc, text = run_cli(
            ["export", str(root), str(tmp_path / "out"), "--format", "hf", "--config", str(path)]
        )
    assert rc == 2 and len(text.strip().splitlines()) == 1, text
    assert "config" in text and str(path) in text, text


@pytest.mark.parametrize("kind", ["fifo", "dev-zero", "sparse"])
def test_read_path_refuses_before_reading(tmp_path, kind):
    path = SPECIAL[kind](tmp_path)
    with bounded_memory(), pytest.raises(flashckpt.ConfigError, match=str(path)):
        safeopen.read_path(path, max_bytes=1 << 20)


def test_lightning_pointer_is_bounded(tmp_path):
    pytest.importorskip("lightning")
    from flashckpt.integrations.lightning import read_pointer

    for path in (sparse(tmp_path / "x.ckpt"), SPECIAL["fifo"](tmp_path)):
        with bounded_memory(), pytest.raises(flashckpt.ConfigError):
            read_pointer(path)
