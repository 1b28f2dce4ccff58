"""Every chunk is verified on load; damage falls back to an older checkpoint or is named."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import flashckpt


def _chunk_files(root: Path) -> list[Path]:
    return sorted(p for p in (root / "chunks").rglob("*") if p.is_file())


def _two_steps(tmp_path, make_state):
    """Steps 1 and 2 whose model weights differ; returns (state, weights at 1, new chunks of 2)."""
    state = make_state(trained=1)
    with flashckpt.Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, state)
        w1 = state["model"].fc1.weight.detach().clone()
        before = set(_chunk_files(tmp_path))
        with torch.no_grad():
            for p in state["model"].parameters():
                p.mul_(2)
        ckpt.save(2, state)
    new = [p for p in _chunk_files(tmp_path) if p not in before]
    assert new, "step 2 should have written new chunks"
    return state, w1, new


def _flip_byte(path: Path, offset: int = 7) -> None:
    data = bytearray(path.read_bytes())
    data[offset % len(data)] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete", "manifest"])
def test_damage_falls_back_to_older_step(tmp_path, make_state, damage):
    _, w1, new_chunks = _two_steps(tmp_path, make_state)
    if damage == "flip":
        _flip_byte(new_chunks[0])
    elif damage == "truncate":
        new_chunks[0].write_bytes(new_chunks[0].read_bytes()[:-3])
    elif damage == "delete":
        new_chunks[0].unlink()
    else:
        (tmp_path / "steps" / "000000000002.json").write_text("{not json")
    target = make_state(trained=0, seed=3)
    with flashckpt.Checkpointer(tmp_path) as ckpt:
        with pytest.warns(UserWarning, match="skipping damaged checkpoint step 2"):
            assert ckpt.restore(target) == 1
    assert torch.equal(target["model"].fc1.weight, w1)
    events = [json.loads(x) for x in (tmp_path / "journal.jsonl").read_text().splitlines()]
    assert any(e["event"] == "corrupt" and e["step"] == 2 for e in events)


def test_explicit_step_names_key_and_chunk(tmp_path, make_state):
    _, _, new_chunks = _two_steps(tmp_path, make_state)
    _flip_byte(new_chunks[0])
    chunk = new_chunks[0].name.split(".")[0]
    with flashckpt.Checkpointer(tmp_path) as ckpt:
        with pytest.raises(flashckpt.CorruptCheckpointError) as info:
            ckpt.restore(make_state(trained=0), step=2)
    assert info.value.chunk == chunk and chunk in str(info.value)
    assert info.value.key and info.value.key in str(info.value)
    assert info.value.step == 2


def test_single_bit_flip_anywhere_is_detected(tmp_path):
    t = torch.randn(4096)
    with flashckpt.Checkpointer(tmp_path) as ckpt:
        ckpt.save(0, {"t": t})
    (chunk,) = _chunk_files(tmp_path)
    raw = chunk.read_bytes()
    for pos in (0, 1, len(raw) // 2, len(raw) - 1):
        damaged = bytearray(raw)
        damaged[pos] ^= 0x80
        chunk.write_bytes(bytes(damaged))
        with flashckpt.Checkpointer(tmp_path) as ckpt:
            with pytest.raises(flashckpt.CorruptCheckpointError):
                ckpt.restore({"t": torch.zeros(4096)}, step=0)
    chunk.write_bytes(raw)
    out = torch.zeros(4096)
    with flashckpt.Checkpointer(tmp_path) as ckpt:
        ckpt.restore({"t": out}, step=0)
    assert torch.equal(out, t)


def test_verify_cli_exit_codes(tmp_path, make_state):
    _, _, new_chunks = _two_steps(tmp_path, make_state)
    cmd = [sys.executable, "-m", "flashckpt.cli", "verify", str(tmp_path)]
    ok = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr
    assert "2 of 2 checkpoints ok" in ok.stdout
    _flip_byte(new_chunks[0])
    bad = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 1
    assert "DAMAGED" in bad.stdout and new_chunks[0].name.split(".")[0] in bad.stdout


@pytest.mark.parametrize("damage", ["truncate", "delete"])
def test_missing_or_truncated_chunk_leaves_state_untouched(tmp_path, make_state, damage):
    _, _, new_chunks = _two_steps(tmp_path, make_state)
    victim = new_chunks[-1]
    if damage == "truncate":
        victim.write_bytes(victim.read_bytes()[:-1])
    else:
        victim.unlink()
    target = make_state(trained=0, seed=11)
    before = {k: v.clone() for k, v in target["model"].state_dict().items()}
    with flashckpt.Checkpointer(tmp_path) as ckpt:
        with pytest.raises(flashckpt.CorruptCheckpointError, match=victim.name.split(".")[0]):
            ckpt.restore(target, step=2)
    for k, v in target["model"].state_dict().items():
        assert torch.equal(v, before[k]), f"{k} was modified by a restore that failed"
