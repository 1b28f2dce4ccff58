"""Fixtures for the hostile-input suite: a guarded directory outside the checkpoint root, and a
root with two valid steps to fall back on."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from pathlib import Path

import pytest

import flashckpt
from hostile.util import small_state


class Outside:
    """A directory outside every root, with files a planted symlink may point at. ``check()``
    fails if anything in it was read-modified, changed, created or deleted."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.mkdir()
        (path / "victim.txt").write_text("do not touch\n")
        (path / "sub").mkdir()
        (path / "sub" / "victim2.bin").write_bytes(b"\x00" * 64)
        self._before = self.snapshot()

    def snapshot(self) -> dict[str, tuple[str, int]]:
        out = {}
        for p in sorted(self.path.rglob("*")):
            st = os.lstat(p)
            digest = hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
            out[str(p.relative_to(self.path))] = (digest, st.st_mtime_ns if p.is_file() else 0)
        return out

    def check(self) -> None:
        assert self.snapshot() == self._before, "a file outside the root was changed"


@pytest.fixture
def outside(tmp_path: Path) -> Outside:
    return Outside(tmp_path / "outside")


@pytest.fixture
def two_steps(tmp_path: Path) -> Callable[[], Path]:
    """``two_steps()``: a root holding valid steps 1 and 2 (w = 1.0 and 2.0)."""

    def build() -> Path:
        root = tmp_path / "root"
        with flashckpt.Checkpointer(root) as ckpt:
            ckpt.save(1, small_state(1.0))
            ckpt.save(2, small_state(2.0))
        return root

    return build
