"""`flashckpt verify ROOT` checks every tier a restore of ROOT reads, the memory tier first.

Regression: verify re-hashed ROOT's own chunks only, so a damaged memory-tier copy (the one
restore reads first) passed with "ok"."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import flashckpt
from flashckpt.cli import main


def _save(root: Path, mem: Path) -> None:
    with flashckpt.Checkpointer(root, memory_tier=mem, keep_memory_after_close=True) as ck:
        ck.save(1, {"w": torch.arange(1000, dtype=torch.float32)})
        ck.save(2, {"w": torch.arange(1000, dtype=torch.float32) + 1})
        assert ck.wait_promoted(60)


def _damage_one_chunk(tier: Path) -> None:
    chunk = next(p for p in (tier / "chunks").rglob("*") if p.is_file())
    os.chmod(chunk, 0o600)
    data = bytearray(chunk.read_bytes())
    data[10] ^= 0xFF
    chunk.write_bytes(bytes(data))


@pytest.fixture
def tiers(tmp_path: Path) -> tuple[Path, Path]:
    root, mem = tmp_path / "root", tmp_path / "mem"
    _save(root, mem)
    return root, mem


def test_damaged_memory_tier_copy_fails_verify_naming_tier_and_step(tiers, capsys) -> None:
    root, mem = tiers
    assert main(["verify", str(root)]) == 0
    out = capsys.readouterr().out
    assert "memory tier step 2: ok" in out and "local tier step 2: ok" in out, out
    assert "4 of 4 checkpoint copies ok" in out
    _damage_one_chunk(mem)
    assert main(["verify", str(root)]) == 1
    out = capsys.readouterr().out
    assert "DAMAGED memory tier step" in out, out
    assert "local tier step 1: ok" in out and "local tier step 2: ok" in out
    assert "damaged: memory tier step" in out


def test_explicit_memory_tier_flag(tmp_path: Path, tiers, capsys) -> None:
    root, mem = tiers
    (root / "tiers.json").unlink()  # nothing recorded: only the flag names the memory tier
    assert main(["verify", str(root)]) == 0
    assert "memory" not in capsys.readouterr().out
    _damage_one_chunk(mem)
    assert main(["verify", str(root), "--memory-tier", str(mem), "--step", "2"]) in (0, 1)
    rc = main(["verify", str(root), "--memory-tier", str(mem)])
    out = capsys.readouterr().out
    assert rc == 1 and "DAMAGED memory tier step" in out, out


def test_a_named_tier_that_cannot_be_read_is_not_ok(tiers, tmp_path: Path, capsys) -> None:
    root, _ = tiers
    rc = main(["verify", str(root), "--memory-tier", str(tmp_path / "nowhere")])
    err = capsys.readouterr().err
    errors = [ln for ln in err.splitlines() if "error" in ln]
    assert rc == 2 and len(errors) == 1 and "NOT VERIFIED: memory tier" in errors[0], err


def test_verifying_a_memory_tier_directly_still_works(tiers, capsys) -> None:
    _, mem = tiers
    assert main(["verify", str(mem), "--step", "1"]) == 0
    out = capsys.readouterr().out
    assert "step 1: ok" in out and "1 of 1 checkpoints ok" in out, out
