"""Issue 27: the idle scrub finds damage that leaves a chunk's size and mtime alone.

Bit rot keeps every timestamp; from userspace the nearest thing is damage followed by
``os.utime`` putting the mtime back (the ctime still changes, so the save path's stamps would
notice: these tests drive the scrubber directly, or let the engine's idle scrub find it).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch

import flashckpt
from flashckpt.engine.runtime import hostcpu
from flashckpt.engine.tiers import scrubbing
from flashckpt.errors import ConfigError
from flashckpt.store.files.backend import LocalBackend
from flashckpt.store.scrub import Scrubber
from flashckpt.store.store import CheckpointStore

CHUNK = "64KiB"


def _state(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"t{i}": torch.randn(16 << 10, generator=g) for i in range(4)}  # 4 chunks of 64 KiB


def _chunk_files(root: Path) -> list[Path]:
    return sorted(p for p in (root / "chunks").rglob("*") if p.is_file() and ".tmp-" not in p.name)


def _rot(path: Path) -> None:
    """Flip a byte in place and put the mtime back (what bit rot looks like, but for ctime)."""
    st = os.stat(path)
    fd = os.open(path, os.O_RDWR)
    try:
        (b,) = os.pread(fd, 1, 100)
        os.pwrite(fd, bytes([b ^ 0x01]), 100)
    finally:
        os.close(fd)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert os.stat(path).st_mtime_ns == st.st_mtime_ns


def _journal(root: Path) -> list[dict]:
    return [json.loads(x) for x in (root / "journal.jsonl").read_text().splitlines()]


def test_regression_scrub_finds_and_quarantines_bit_rot(tmp_path):
    """A rotten chunk of a committed step is found, moved to quarantine/, and the next save
    of the same state writes it again, so that step restores (and so does the old one)."""
    state = _state()
    with flashckpt.Checkpointer(tmp_path, chunk_size=CHUNK, scrub_bytes_per_s=0) as ckpt:
        ckpt.save(1, state)
    victim = _chunk_files(tmp_path)[2]
    _rot(victim)
    store = CheckpointStore(LocalBackend(tmp_path))
    res = Scrubber(store).step(1 << 30)
    assert res.checked == 4
    assert [d.chunk for d in res.damaged] == [victim.name]
    (damage,) = res.damaged
    assert damage.steps == (1,) and damage.quarantined and "does not match its hash" in damage.error
    assert not victim.exists() and len(list((tmp_path / "quarantine").iterdir())) == 1
    with flashckpt.Checkpointer(tmp_path, chunk_size=CHUNK, scrub_bytes_per_s=0) as ckpt:
        again = ckpt.save(2, state).wait()
        assert again.chunks_new >= 1  # the quarantined chunk, written again
        for step in (1, 2):
            out = {k: torch.zeros_like(v) for k, v in state.items()}
            assert ckpt.restore(out, step=step) == step
            assert all(torch.equal(out[k], state[k]) for k in state)


def test_scrub_steps_are_bounded_and_go_round_robin(tmp_path):
    """Each step reads about its budget (at least one chunk), oldest-verified first: one
    chunk's worth per step visits every chunk once before any twice."""
    with flashckpt.Checkpointer(tmp_path, chunk_size=CHUNK, scrub_bytes_per_s=0) as ckpt:
        ckpt.save(1, _state())
    store = CheckpointStore(LocalBackend(tmp_path))
    scrubber = Scrubber(store)
    seen: list[str] = []
    real = store.read_chunk

    def spy(ref, **kw):
        seen.append(ref.hash)
        return real(ref, **kw)

    store.read_chunk = spy  # type: ignore[method-assign]
    for _ in range(4):
        res = scrubber.step(1)
        assert res.checked == 1 and res.bytes == 64 << 10 and not res.damaged
    assert len(set(seen)) == 4, seen
    scrubber.step(1)
    assert seen[4] == seen[0], "the chunk verified longest ago comes next"
    with pytest.raises(ConfigError, match="budget_bytes"):
        scrubber.step(0)


def test_scrub_calls_nothing_damage_that_retention_deleted(tmp_path):
    """A chunk gone because retention deleted its only step after the scrub listed it is not
    damage (a missing chunk that a committed step still names is)."""
    with flashckpt.Checkpointer(tmp_path, chunk_size=CHUNK, scrub_bytes_per_s=0) as ckpt:
        ckpt.save(1, _state())
    store = CheckpointStore(LocalBackend(tmp_path))
    real = store.read_chunk

    def retention_ran_meanwhile(ref, **kw):
        (tmp_path / "steps" / "000000000001.json").unlink()
        for p in _chunk_files(tmp_path):
            p.unlink()
        return real(ref, **kw)

    store.read_chunk = retention_ran_meanwhile  # type: ignore[method-assign]
    res = Scrubber(store).step(1)
    assert res.checked == 1 and res.damaged == []

    with flashckpt.Checkpointer(tmp_path / "b", chunk_size=CHUNK, scrub_bytes_per_s=0) as ckpt:
        ckpt.save(1, _state())
    _chunk_files(tmp_path / "b")[0].unlink()  # missing while step 1 names it: damage
    res = Scrubber(CheckpointStore(LocalBackend(tmp_path / "b"))).step(1 << 30)
    assert [d.steps for d in res.damaged] == [(1,)]
    assert "missing" in res.damaged[0].error and not res.damaged[0].quarantined


def test_a_partial_tier_calls_an_absent_chunk_no_damage_and_still_finds_rot(tmp_path):
    """A node-local memory tier (peer replication) holds only its node's chunks and replicas
    of its steps: a chunk absent there is another node's, not damage; a present one that
    rotted is still damage."""
    with flashckpt.Checkpointer(tmp_path, chunk_size=CHUNK, scrub_bytes_per_s=0) as ckpt:
        ckpt.save(1, _state())
    files = _chunk_files(tmp_path)
    files[0].unlink()  # on another node
    _rot(files[1])
    store = CheckpointStore(LocalBackend(tmp_path))
    res = Scrubber(store, partial=True).step(1 << 30)
    assert [d.chunk for d in res.damaged] == [files[1].name]
    assert res.checked == 3  # the absent chunk was not counted as read
    whole = Scrubber(CheckpointStore(LocalBackend(tmp_path))).step(1 << 30)
    assert [d.chunk for d in whole.damaged] == [files[0].name]  # a whole tier: missing


def test_the_engine_scrubs_in_idle_time_and_journals_damage(tmp_path, monkeypatch):
    """The Checkpointer's promotion thread scrubs the disk tier when nothing else happens,
    journals ``scrub_damage`` and quarantines the chunk; the next save writes it again."""
    monkeypatch.setattr(scrubbing, "QUIET_S", 0.1)
    monkeypatch.setattr(hostcpu, "MIN_IDLE_CORES", 0.0)  # other tests keep the cores busy
    state = _state()
    with flashckpt.Checkpointer(tmp_path, chunk_size=CHUNK, scrub_bytes_per_s="64MiB") as ckpt:
        ckpt.save(1, state)
        victim = _chunk_files(tmp_path)[1]
        _rot(victim)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if any(e["event"] == "scrub_damage" for e in _journal(tmp_path)):
                break
            time.sleep(0.05)
        (event,) = [e for e in _journal(tmp_path) if e["event"] == "scrub_damage"]
        assert event["chunk"] == victim.name and event["tier"] == "local"
        assert event["steps"] == [1] and event["quarantined"] is True
        assert not victim.exists()
        again = ckpt.save(2, state).wait()
        assert again.chunks_new == 1 and again.chunks_reused == 3
        out = {k: torch.zeros_like(v) for k, v in state.items()}
        assert ckpt.restore(out, step=2) == 2
    assert all(torch.equal(out[k], state[k]) for k in state)


def test_the_engine_journals_what_its_scrub_read(tmp_path, monkeypatch):
    """``scrubbed`` (tier, bytes, chunks, seconds) says how much the idle scrub verified, for
    the report and the metrics; journaled every REPORT_S (lowered here to every step)."""
    monkeypatch.setattr(scrubbing, "QUIET_S", 0.1)
    monkeypatch.setattr(hostcpu, "MIN_IDLE_CORES", 0.0)  # other tests keep the cores busy
    monkeypatch.setattr(scrubbing, "REPORT_S", 0.0)
    with flashckpt.Checkpointer(tmp_path, chunk_size=CHUNK, scrub_bytes_per_s="64MiB") as ckpt:
        ckpt.save(1, _state())
        deadline, read = time.monotonic() + 30, []
        while time.monotonic() < deadline and sum(e["chunks"] for e in read) < 4:
            read = [e for e in _journal(tmp_path) if e["event"] == "scrubbed"]
            time.sleep(0.05)
    assert {e["tier"] for e in read} == {"local"}
    assert sum(e["chunks"] for e in read) >= 4 and sum(e["bytes"] for e in read) >= 4 * 65536


def test_scrub_rate_zero_turns_it_off_and_bad_rates_are_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(scrubbing, "QUIET_S", 0.0)
    with flashckpt.Checkpointer(tmp_path / "a", chunk_size=CHUNK, scrub_bytes_per_s=0) as ckpt:
        ckpt.save(1, _state())
        _rot(_chunk_files(tmp_path / "a")[0])
        time.sleep(1.0)
        assert ckpt._tiers.promoter._idle is None
    assert not any(e["event"] == "scrub_damage" for e in _journal(tmp_path / "a"))
    for bad in (-1, "fast", True):
        with pytest.raises(ConfigError, match="scrub_bytes_per_s"):
            flashckpt.Checkpointer(tmp_path / "b", scrub_bytes_per_s=bad)
