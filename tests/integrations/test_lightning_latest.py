"""lightning.latest_checkpoint: the pointer naming the newest step, not the last name."""

from __future__ import annotations

import json
import os
from pathlib import Path

from flashckpt.integrations.lightning import POINTER_KEY, latest_checkpoint


def _pointer(path: Path, step: int, mtime: float) -> None:
    path.write_text(json.dumps({POINTER_KEY: str(path.parent / "flashckpt"), "step": step}))
    os.utime(path, (mtime, mtime))


def test_newest_step_wins_over_text_order_and_non_pointers(tmp_path: Path) -> None:
    assert latest_checkpoint(tmp_path) is None
    _pointer(tmp_path / "epoch=11-step=192.ckpt", 192, 1000.0)
    _pointer(tmp_path / "epoch=3-step=64.ckpt", 64, 2000.0)  # newer file, older step
    (tmp_path / "zzz-regular.ckpt").write_bytes(b"PK\x03\x04 not a pointer")
    best = latest_checkpoint(tmp_path)
    assert best is not None and best.name == "epoch=11-step=192.ckpt"
    _pointer(tmp_path / "last.ckpt", 192, 3000.0)  # same step, written later
    best = latest_checkpoint(tmp_path)
    assert best is not None and best.name == "last.ckpt"
