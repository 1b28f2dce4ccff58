"""Tiers in one process: placement, retention per tier, promotion, restore fallbacks, faults."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from collections import namedtuple
from pathlib import Path
from typing import Any

import pytest
import torch

import flashckpt
from flashckpt.engine.tiers import config as tierconfig
from flashckpt.engine.tiers import promote, tiercopy
from flashckpt.engine.tiers import tierset as tiers
from flashckpt.engine.tiers.promote import Promotion
from flashckpt.errors import ConfigError, StorageError
from flashckpt.journal import read_events
from flashckpt.policy import KeepEvery, KeepLast
from flashckpt.store.files import directio
from flashckpt.store.files.remote import FsspecBackend

FAST = Promotion(retries=20, backoff_s=0.05, max_backoff_s=0.2)


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(600, 600), torch.nn.Linear(600, 8))


def _bump(m: torch.nn.Module) -> None:
    with torch.no_grad():
        for p in m.parameters():
            p.add_(1.0)


def _steps(d: Path) -> list[int]:
    return sorted(
        int(p.name.split(".")[0]) for p in (d / "steps").glob("*.json") if "rank" not in p.name
    )


def _events(root: Path, name: str) -> list[dict[str, Any]]:
    return [e for e in read_events(root) if e["event"] == name]


def _same(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


def _s3_steps(url: str) -> list[int]:
    return FsspecBackendSteps(url)


def FsspecBackendSteps(url: str) -> list[int]:
    from flashckpt.store.store import CheckpointStore

    return CheckpointStore(FsspecBackend(url)).steps()


def test_each_tier_keeps_its_own_retention(
    tmp_path: Path, shm_dir: Path, s3_env: str, s3_bucket: str
) -> None:
    root, url = tmp_path / "ck", f"s3://{s3_bucket}/run"
    m = _model()
    with flashckpt.Checkpointer(
        root,
        memory_tier=shm_dir,
        keep_memory=KeepLast(2),
        keep_memory_after_close=True,  # the memory tier's own retention is what is checked
        keep=KeepLast(3),
        remote=url,
        keep_remote=KeepEvery(2),
        promotion=FAST,
    ) as ck:
        for step in range(1, 7):
            _bump(m)
            ck.save(step, {"m": m})
        assert ck.steps()[-1] == 6
    assert _steps(shm_dir) == [5, 6]
    assert _steps(root) == [4, 5, 6]
    assert _s3_steps(url) == [2, 4, 6]
    durable = _events(root, "durable")
    assert {e["tier"] for e in durable} == {"memory"}
    promoted = _events(root, "promoted")
    assert {(e["step"], e["dst"]) for e in promoted} >= {(s, "local") for s in range(1, 7)}
    assert {e["step"] for e in promoted if e["dst"] == "remote"} == {2, 4, 6}
    assert all(e["src"] == "memory" and e["seconds"] >= 0 and e["bytes"] > 0 for e in promoted)
    gc = _events(root, "gc")
    assert {e["tier"] for e in gc} >= {"memory", "local"}
    cfg = tierconfig.read_config(root)
    assert cfg == {"memory": str(shm_dir), "local": str(root), "remote": url}


def test_chunks_present_in_a_tier_are_not_copied_again(tmp_path: Path, shm_dir: Path) -> None:
    root = tmp_path / "ck"
    m = _model()
    with flashckpt.Checkpointer(root, memory_tier=shm_dir, promotion=FAST) as ck:
        ck.save(1, {"m": m})
        ck.save(2, {"m": m})  # identical state
        with torch.no_grad():
            m[1].bias.add_(1)  # only the small packed chunk changes
        ck.save(3, {"m": m})
    by_step = {e["step"]: e for e in _events(root, "promoted")}
    assert by_step[1]["bytes"] > 600 * 600 * 4
    assert by_step[2]["bytes"] == 0 and by_step[2]["chunks"] == 0
    assert 0 < by_step[3]["bytes"] < 600 * 600 * 4


def test_promotion_copies_verified_chunks_past_the_page_cache(
    tmp_path: Path, shm_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Raw chunks travel memory -> disk through page-aligned buffers, are verified on the way
    (a damaged memory copy never reaches the disk), and land with O_DIRECT."""
    root = tmp_path / "ck"
    m = _model()
    real_copy = tiercopy.ChunkCopier.copy
    damage: dict[str, Any] = {"on": False, "tier": shm_dir / "x"}

    def damage_then_copy(self: Any, *args: Any) -> Any:
        if damage["on"]:  # flip a byte of the memory tier's biggest chunk just before the copy
            damage["on"] = False
            big = max(
                (p for p in (damage["tier"] / "chunks").rglob("*") if p.is_file()),
                key=lambda p: p.stat().st_size,
            )
            raw = bytearray(big.read_bytes())
            raw[7] ^= 0x01
            big.write_bytes(bytes(raw))
        return real_copy(self, *args)

    monkeypatch.setattr(tiercopy.ChunkCopier, "copy", damage_then_copy)
    with flashckpt.Checkpointer(root, memory_tier=shm_dir, promotion=FAST) as ck:
        _bump(m)
        ck.save(1, {"m": m})
        disk = ck.store.backend
    # close() waited for promotion
    assert _steps(root) == [1]
    assert (disk.direct_bytes > 0) == directio.supported(root)
    with flashckpt.Checkpointer(root) as ck:  # the disk tier alone
        fresh = _model(seed=1)
        assert ck.restore({"m": fresh}) == 1 and _same(fresh, m)
    with flashckpt.Checkpointer(root / "x", memory_tier=shm_dir / "x", promotion=FAST) as ck:
        damage["on"] = True
        _bump(m)
        ck.save(2, {"m": m})
    assert _steps(root / "x") == [], "the damaged memory copy must not be promoted"
    corrupt = _events(root / "x", "corrupt")
    assert corrupt and corrupt[-1]["tier"] == "memory" and corrupt[-1]["step"] == 2


def test_restore_prefers_fastest_and_falls_back_on_a_damaged_copy(
    tmp_path: Path, shm_dir: Path
) -> None:
    root = tmp_path / "ck"
    m = _model()
    keep = {"keep_memory_after_close": True}  # the memory copy is what each restore reads
    with flashckpt.Checkpointer(root, memory_tier=shm_dir, promotion=FAST, **keep) as ck:
        _bump(m)
        ck.save(1, {"m": m})
    with flashckpt.Checkpointer(root, memory_tier=shm_dir, **keep) as ck:
        fresh = _model(seed=1)
        assert ck.restore({"m": fresh}) == 1 and _same(fresh, m)
    assert _events(root, "restore")[-1]["tier"] == "memory"
    big = max(
        (p for p in (shm_dir / "chunks").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size
    )
    raw = bytearray(big.read_bytes())
    raw[1000] ^= 0xFF
    big.write_bytes(bytes(raw))
    with flashckpt.Checkpointer(root, memory_tier=shm_dir, **keep) as ck:
        fresh = _model(seed=2)
        with pytest.warns(RuntimeWarning, match="memory copy failed"):
            assert ck.restore({"m": fresh}) == 1
        assert _same(fresh, m)
    corrupt = _events(root, "corrupt")
    assert corrupt and corrupt[-1]["tier"] == "memory" and corrupt[-1]["step"] == 1
    assert _events(root, "restore")[-1]["tier"] == "local"


def test_remote_unreachable_during_promotion_is_retried(
    tmp_path: Path, s3_env: str, s3_bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    fails = {"left": 3}
    real_put = FsspecBackend.put

    def flaky_put(self: FsspecBackend, path: str, parts: Any) -> int:
        if fails["left"] > 0:
            fails["left"] -= 1
            raise ConnectionRefusedError(111, "Connection refused (injected)")
        return real_put(self, path, parts)

    monkeypatch.setattr(FsspecBackend, "put", flaky_put)
    root, url = tmp_path / "ck", f"s3://{s3_bucket}/run"
    m = _model()
    with flashckpt.Checkpointer(root, remote=url, promotion=FAST) as ck:
        ck.save(1, {"m": m}).wait()  # training continues: the save itself is durable locally
        assert _steps(root) == [1]
    assert fails["left"] == 0
    failed = _events(root, "promote_failed")
    assert failed and failed[0]["dst"] == "remote" and "refused" in failed[0]["error"]
    assert [e["step"] for e in _events(root, "promoted")] == [1]
    assert _s3_steps(url) == [1]


def test_promotion_gives_up_after_retries_and_training_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def always_down(self: FsspecBackend, path: str, parts: Any) -> int:
        raise ConnectionResetError(104, "reset (injected)")

    monkeypatch.setattr(FsspecBackend, "put", always_down)
    root = tmp_path / "ck"
    with flashckpt.Checkpointer(
        root,
        remote="memory://flashckpt-down/run",
        promotion=Promotion(retries=2, backoff_s=0.01, max_backoff_s=0.01),
    ) as ck:
        ck.save(1, {"m": _model()})
        ck.save(2, {"m": _model()})
    abandoned = _events(root, "promote_abandoned")
    assert [e["step"] for e in abandoned] == [1, 2]
    assert _steps(root) == [1, 2]


def test_pins_keep_chunks_alive_until_promoted(
    tmp_path: Path, shm_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_copy = promote.copy_step

    def slow_copy(src: Any, dst: Any, manifest: Any, copier: Any, **kw: Any) -> tuple[int, int]:
        time.sleep(0.15)  # memory retention runs (and deletes) meanwhile
        return real_copy(src, dst, manifest, copier, **kw)

    monkeypatch.setattr(promote, "copy_step", slow_copy)
    root = tmp_path / "ck"
    m = _model()
    states = []
    with flashckpt.Checkpointer(
        root, memory_tier=shm_dir, keep_memory=1, keep_memory_after_close=True, promotion=FAST
    ) as ck:
        for step in range(1, 5):
            _bump(m)
            ck.save(step, {"m": m})
            states.append({k: v.clone() for k, v in m.state_dict().items()})
    assert _steps(shm_dir) == [4]
    assert _steps(root) == [1, 2, 3, 4]
    with flashckpt.Checkpointer(root) as ck:  # local only: every promoted step is whole
        for step in range(1, 5):
            fresh = _model(seed=9)
            ck.restore({"m": fresh}, step=step)
            assert all(torch.equal(fresh.state_dict()[k], v) for k, v in states[step - 1].items())


def test_short_dev_shm_falls_back_to_local(
    tmp_path: Path, shm_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(tiers.shutil, "disk_usage", lambda p: usage(1 << 20, 1 << 20, 4096))
    root = tmp_path / "ck"
    m = _model()
    with flashckpt.Checkpointer(root, memory_tier=shm_dir) as ck:
        with pytest.warns(RuntimeWarning, match="memory tier .* bytes free"):
            ck.save(1, {"m": m})
    assert _steps(root) == [1] and _steps(shm_dir) == []
    fb = _events(root, "tier_fallback")
    assert fb and fb[0]["to"] == "local" and fb[0]["free_bytes"] == 4096
    assert _events(root, "durable")[0]["tier"] == "local"


def test_deleted_tier_directory_is_a_clear_error_and_other_tiers_survive(
    tmp_path: Path, shm_dir: Path
) -> None:
    root = tmp_path / "ck"
    m = _model()
    ck = flashckpt.Checkpointer(root, memory_tier=shm_dir, promotion=FAST)
    try:
        _bump(m)
        ck.save(1, {"m": m})
        assert ck.wait_promoted(timeout_s=30)
        shutil.rmtree(shm_dir)
        with pytest.raises(StorageError, match=f"memory tier {shm_dir} was deleted"):
            ck.save(2, {"m": m})
    finally:
        ck.close()
    with flashckpt.Checkpointer(root, memory_tier=shm_dir) as ck2:
        fresh = _model(seed=3)
        assert ck2.restore({"m": fresh}) == 1 and _same(fresh, m)
    assert _events(root, "restore")[-1]["tier"] == "local"


def test_bad_tier_options_are_config_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError):
        flashckpt.Checkpointer(tmp_path / "a", remote="bucket-without-scheme")
    with pytest.raises(ConfigError):
        Promotion(retries=0)
    with pytest.raises(ConfigError, match="workers"):
        Promotion(workers=0)
    with pytest.raises(ConfigError):
        flashckpt.Checkpointer(tmp_path / "b", handle_sigterm=True, grace_period_s=0)
    with pytest.raises(ConfigError):
        flashckpt.Checkpointer(tmp_path / "c", keep_memory="two", memory_tier=tmp_path / "m")
    # a failed constructor releases the root: it can be opened again
    flashckpt.Checkpointer(tmp_path / "a").close()


def test_ls_shows_the_tiers_of_each_step(
    tmp_path: Path, shm_dir: Path, s3_env: str, s3_bucket: str
) -> None:
    root, url = tmp_path / "ck", f"s3://{s3_bucket}/run"
    m = _model()
    with flashckpt.Checkpointer(
        root,
        memory_tier=shm_dir,
        keep_memory=1,
        keep_memory_after_close=True,
        remote=url,
        keep_remote=KeepEvery(2),
        promotion=FAST,
    ) as ck:
        for step in (1, 2, 3):
            _bump(m)
            ck.save(step, {"m": m})
    out = subprocess.run(
        [sys.executable, "-m", "flashckpt.cli", "ls", str(root)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    rows = {ln.split()[0]: ln.split()[-1] for ln in out.splitlines()[2:]}
    assert rows == {"1": "local", "2": "local,remote", "3": "memory,local"}, out
    assert "tiers" in out.splitlines()[0]
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "flashckpt.cli",
            "ls",
            str(root),
            "--memory-tier",
            str(tmp_path / "none"),
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert {ln.split()[0]: ln.split()[-1] for ln in out.splitlines()[2:]}["3"] == "local"


def test_promotion_copies_several_chunks_at_once(tmp_path: Path, shm_dir: Path) -> None:
    import threading

    from flashckpt.store.files.backend import LocalBackend

    state = {"peak": 0, "active": 0}
    lock = threading.Lock()

    class Counting(LocalBackend):
        def put(self, path: str, parts: Any) -> int:
            if not path.startswith("chunks/"):
                return super().put(path, parts)
            with lock:
                state["active"] += 1
                state["peak"] = max(state["peak"], state["active"])
            try:
                time.sleep(0.05)  # a slow disk or a remote request
                return super().put(path, parts)
            finally:
                with lock:
                    state["active"] -= 1

    root = tmp_path / "ck"
    m = _model()
    opts = Promotion(workers=3, retries=3, backoff_s=0.05, max_backoff_s=0.1)
    with flashckpt.Checkpointer(
        root, memory_tier=shm_dir, promotion=opts, chunk_size="256KiB"
    ) as ck:
        ck.store.backend = Counting(root)  # the disk tier, where promotion writes
        _bump(m)
        ck.save(1, {"m": m})
    assert 2 <= state["peak"] <= 3, state
    promoted = _events(root, "promoted")
    assert promoted and promoted[-1]["chunks"] >= 6  # the 1.4 MB weight in 256 KiB chunks
    with flashckpt.Checkpointer(root) as ck:
        fresh = _model(seed=1)
        assert ck.restore({"m": fresh}) == 1 and _same(fresh, m)


def test_chunk_copier_stops_at_the_first_error_and_raises_it() -> None:
    from types import SimpleNamespace

    from flashckpt.store.format.manifest import ChunkRef

    puts: list[str] = []

    def put_chunk(h: str, size: int, parts: Any, codec: str) -> ChunkRef:
        puts.append(h)
        if h == "b" * 32:
            raise OSError(28, "No space left on device (injected)")
        return ChunkRef(hash=h, size=size, codec=codec, stored_size=size)

    src = SimpleNamespace(store=SimpleNamespace(read_chunk=lambda ref, step: b"x" * ref.size))
    dst = SimpleNamespace(store=SimpleNamespace(put_chunk=put_chunk))
    refs = [ChunkRef(hash=c * 32, size=8, codec="zstd", stored_size=4) for c in "abcdef"]
    copier = tiercopy.ChunkCopier(1)
    with pytest.raises(OSError, match="injected"):
        copier.copy(src, dst, refs, 1)  # type: ignore[arg-type]
    assert puts == ["a" * 32, "b" * 32], "no chunk is started after the first error"
    puts.clear()
    ok = copier.copy(src, dst, [refs[0], refs[2]], 1)  # type: ignore[arg-type]
    assert [r.hash for r in ok] == ["a" * 32, "c" * 32]
