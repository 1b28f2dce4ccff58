"""Nothing from disk runs code (imports), and every CLI error is one line with exit 2."""

from __future__ import annotations

import contextlib
import io
import os
import pickle
from pathlib import Path

import pytest
import torch

import flashckpt
from flashckpt.cli import main
from flashckpt.integrations import interop
from flashckpt.integrations.dcp_metadata import read_metadata
from hostile.util import small_state

pytestmark = pytest.mark.timeout(120)


class _Payload:
    """Unpickling this runs ``open(marker, 'w')``: proof that code from disk ran."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _run(*args: str) -> tuple[int, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(list(args))
    return rc, out.getvalue() + err.getvalue()


def _shards(tmp_path: Path) -> Path:
    from safetensors.torch import save_file

    src = tmp_path / "src"
    src.mkdir()
    save_file({"w": torch.arange(4.0)}, str(src / "model-00001.safetensors"))
    return src


def test_auto_detection_never_unpickles_a_stray_metadata_file(tmp_path):
    src = _shards(tmp_path)
    marker = tmp_path / "code-ran"
    (src / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))
    rc, out = _run("import", str(src), str(tmp_path / "root"))
    assert rc == 0, out
    assert not marker.exists()
    with flashckpt.Checkpointer(tmp_path / "root") as ckpt:
        assert ckpt.steps() == [0]


def test_dcp_directory_needs_an_explicit_format(tmp_path):
    src = tmp_path / "dcp"
    interop.write_dcp({"w": torch.arange(4.0)}, src)
    rc, out = _run("import", str(src), str(tmp_path / "root"))
    assert rc == 2 and "--format dcp" in out
    rc, out = _run("import", str(src), str(tmp_path / "root"), "--format", "dcp")
    assert rc == 0, out
    target = {"model": {"w": torch.zeros(4)}}
    with flashckpt.Checkpointer(tmp_path / "root") as ckpt:
        ckpt.restore(target)
    assert torch.equal(target["model"]["w"], torch.arange(4.0))


def test_explicit_dcp_with_a_malicious_metadata_is_refused(tmp_path):
    src = tmp_path / "dcp"
    interop.write_dcp({"w": torch.arange(4.0)}, src)
    marker = tmp_path / "code-ran"
    (src / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))
    rc, out = _run("import", str(src), str(tmp_path / "root"), "--format", "dcp")
    assert rc == 2 and "not a DCP metadata class" in out
    assert not marker.exists()


def test_dcp_storage_record_pointing_outside_is_refused(tmp_path):
    src = tmp_path / "dcp"
    interop.write_dcp({"w": torch.arange(4.0)}, src)
    md = read_metadata(src)
    for info in md.storage_data.values():
        info.relative_path = "../../etc/passwd"
    (src / ".metadata").write_bytes(pickle.dumps(md))
    with pytest.raises(flashckpt.ConfigError, match="not a data file inside"):
        read_metadata(src)


def test_fifo_import_source_is_refused_not_read(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    os.mkfifo(src / "x.safetensors")
    rc, out = _run("import", str(src), str(tmp_path / "root"))
    assert rc == 2 and "regular file" in out
    os.mkfifo(tmp_path / "model.pt")
    rc, out = _run("import", str(tmp_path / "model.pt"), str(tmp_path / "root"))
    assert rc == 2 and "regular file" in out


@pytest.fixture
def root(tmp_path: Path) -> Path:
    with flashckpt.Checkpointer(tmp_path / "root") as ckpt:
        ckpt.save(1, small_state(1.0))
    return tmp_path / "root"


def _one_line_error(rc: int, out: str, path: str) -> None:
    assert rc == 2, out
    assert "Traceback" not in out and path in out
    assert len(out.strip().splitlines()) == 1, out


@pytest.mark.parametrize("fmt", ["safetensors", "torch", "dcp"])
def test_export_under_a_regular_file_is_one_line_exit_2(root, tmp_path, fmt):
    (tmp_path / "file").write_text("x")
    rc, out = _run("export", str(root), str(tmp_path / "file" / "out"), "--format", fmt)
    _one_line_error(rc, out, str(tmp_path / "file"))


@pytest.mark.parametrize("fmt", ["safetensors", "torch"])
def test_export_onto_a_directory_is_one_line_exit_2(root, tmp_path, fmt):
    (tmp_path / "adir").mkdir()
    rc, out = _run("export", str(root), str(tmp_path / "adir"), "--format", fmt)
    _one_line_error(rc, out, str(tmp_path / "adir"))


@pytest.mark.parametrize("fmt", ["safetensors", "torch", "dcp"])
def test_export_to_an_unwritable_place_is_one_line_exit_2(root, fmt):
    rc, out = _run("export", str(root), "/proc/flashckpt-export", "--format", fmt)
    _one_line_error(rc, out, "/proc/flashckpt-export")


def test_report_into_proc_is_one_line_exit_2(root):
    rc, out = _run("report", str(root), "-o", "/proc/flashckpt-report.html")
    _one_line_error(rc, out, "/proc/flashckpt-report.html")
