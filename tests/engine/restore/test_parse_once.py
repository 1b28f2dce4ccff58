"""A restore parses the manifest of the step it loads once.

Parsing is most of what a restore costs per tensor (a manifest of 50,000 tensors: about 0.5 s).
A restore from the memory tier parsed it twice: once to load, and again to queue the step's
promotion to the slower tiers, even when every slower tier already held it (memory-tier
restore 32 us per tensor against 22 from disk). Now the manifest loaded is handed to the
promotion, and a step the slower tiers hold is not promoted again.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import flashckpt
from flashckpt.store import store as store_mod
from flashckpt.store.files.backend import LocalBackend
from flashckpt.store.store import CheckpointStore


def _state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"t{i}": torch.randn(64, generator=g) for i in range(200)}


@pytest.fixture
def parses(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every manifest parse made through the store, by where it was read."""
    seen: list[str] = []
    real = store_mod.parse_manifest

    def counting(data: bytes, *, where: str = "manifest", whole: bool = True):  # type: ignore[no-untyped-def]
        seen.append(where)
        return real(data, where=where, whole=whole)

    monkeypatch.setattr(store_mod, "parse_manifest", counting)
    return seen


def _promoted(root: Path) -> list[int]:
    out = []
    for line in (root / "journal.jsonl").read_text().splitlines():
        e = json.loads(line)
        if e.get("event") == "promoted":
            out.append(e["step"])
    return out


def test_a_step_both_tiers_hold_is_parsed_once_and_not_promoted_again(
    tmp_path: Path, parses: list[str]
) -> None:
    root, mem = tmp_path / "root", tmp_path / "mem"
    with flashckpt.Checkpointer(root, memory_tier=mem, async_save=True) as ck:
        ck.save(1, {"s": _state(1)}).wait()
        assert ck.wait_promoted()
        assert _promoted(root) == [1]
        out = {"s": _state(0)}
        parses.clear()
        assert ck.restore(out) == 1
        assert ck.wait_promoted()
        assert len(parses) == 1, parses  # two before: the load and the promotion's
        assert "mem" in parses[0]  # the memory tier's copy was the one loaded
        assert _promoted(root) == [1]  # the disk held it already: no second copy
    assert all(torch.equal(out["s"][k], _state(1)[k]) for k in out["s"])


def test_a_memory_only_step_is_parsed_once_and_still_promoted(
    tmp_path: Path, parses: list[str]
) -> None:
    """A killed run leaves its newest step in the memory tier alone (the cadence skipped its
    promotion): the restore loads it from there and promotes it from the manifest it loaded."""
    root, mem = tmp_path / "root", tmp_path / "mem"
    script = textwrap.dedent(
        f"""
        import os, signal, torch, flashckpt
        ck = flashckpt.Checkpointer({str(root)!r}, memory_tier={str(mem)!r},
                                    promotion=flashckpt.Promotion(every=5))
        for step in (1, 2):
            g = torch.Generator().manual_seed(step)
            s = {{f"t{{i}}": torch.randn(64, generator=g) for i in range(200)}}
            ck.save(step, {{"s": s}}).wait()
            ck.wait_promoted()
        os.kill(os.getpid(), signal.SIGKILL)
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert proc.returncode == -9, proc.stderr
    assert CheckpointStore(LocalBackend(root)).steps() == [1]
    out = {"s": _state(0)}
    every5 = flashckpt.Promotion(every=5)
    with flashckpt.Checkpointer(root, memory_tier=mem, promotion=every5) as ck:
        parses.clear()
        assert ck.restore(out) == 2
        assert ck.wait_promoted()
        assert len(parses) == 1, parses
        assert 2 in _promoted(root)
    assert CheckpointStore(LocalBackend(root)).steps() == [1, 2]
    assert all(torch.equal(out["s"][k], _state(2)[k]) for k in out["s"])
