"""The restore reader's paths, on CPU: chunks mapped and verified before any copy (the memory
tier), chunks read straight into targets or into scratch (disk), compressed chunks, resharded
boxes, and damage (flipped, truncated, a symlink or a FIFO in chunks/) refused without touching
the live state where the path promises it."""

from __future__ import annotations

import copy
import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch

import flashckpt
from flashckpt.engine.restore import reader
from flashckpt.engine.restore.reader import read_plan
from flashckpt.errors import CorruptCheckpointError, StorageError
from flashckpt.state.restore import RestorePlan, Target
from flashckpt.store.files import backend as backend_mod
from flashckpt.store.files.backend import LocalBackend, filesystem_type
from flashckpt.store.format.codec import choose_codec, hash_parts
from flashckpt.store.format.manifest import Extent, Manifest, Shard, TensorEntry
from flashckpt.store.store import CheckpointStore, chunk_path

CHUNK = "64KiB"


@pytest.fixture
def mapped(monkeypatch) -> list:
    """Every LocalBackend counts as in memory (mapped reads); returns the chunks mapped."""
    monkeypatch.setattr(LocalBackend, "in_memory", property(lambda self: True))
    return _spy_maps(monkeypatch)


def _spy_maps(monkeypatch) -> list:
    seen: list = []
    real = CheckpointStore.map_chunk

    def spy(self, ref, **kw):
        seen.append(ref.hash)
        return real(self, ref, **kw)

    monkeypatch.setattr(CheckpointStore, "map_chunk", spy)
    return seen


def _state(seed: int = 0) -> dict:
    """Mixed sizes: tensors over several chunks, small ones packed together, bf16, int64, an
    empty tensor, a numpy array."""
    g = torch.Generator().manual_seed(seed)
    return {
        "big": torch.randn(3 * 16384 + 77, generator=g),
        "mat": torch.randn(130, 257, generator=g),
        "bias": torch.randn(13, generator=g),
        "half": torch.randn(1000, generator=g).to(torch.bfloat16),
        "ids": torch.randint(0, 1 << 40, (33,), generator=g),
        "empty": torch.empty(0, 4),
        "arr": np.arange(35, dtype=np.float64).reshape(5, 7) * (seed + 1),
    }


def _zeroed(state: dict) -> dict:
    out = {}
    for k, v in state.items():
        out[k] = np.zeros_like(v) if isinstance(v, np.ndarray) else torch.zeros_like(v)
    return out


def _equal(a: dict, b: dict) -> bool:
    for k in a:
        x, y = a[k], b[k]
        if isinstance(x, np.ndarray):
            if not np.array_equal(x, y):
                return False
        elif x.dtype != y.dtype or not torch.equal(x, y):
            return False
    return True


def _chunk_files(root: Path) -> list[Path]:
    return sorted(p for p in (root / "chunks").rglob("*") if p.is_file())


@pytest.mark.parametrize("compression", [None, "zstd"])
@pytest.mark.parametrize("maps", [True, False], ids=["mapped", "read"])
def test_roundtrip_bitwise_each_read_path(tmp_path, monkeypatch, compression, maps):
    if maps:
        monkeypatch.setattr(LocalBackend, "in_memory", property(lambda self: True))
    seen = _spy_maps(monkeypatch)
    state = _state()
    with flashckpt.Checkpointer(tmp_path, chunk_size=CHUNK, compression=compression) as ck:
        ck.save(1, state)
    live = _zeroed(state)
    ptr = live["big"].data_ptr()
    assert flashckpt.restore(tmp_path, live) == 1
    assert _equal(state, live)
    assert live["big"].data_ptr() == ptr  # in place
    raw_chunks = [p for p in _chunk_files(tmp_path) if "." not in p.name]
    assert len(seen) == (len(raw_chunks) if maps else 0)


def test_memory_tier_on_tmpfs_is_mapped(tmp_path, monkeypatch):
    if not os.path.isdir("/dev/shm") or filesystem_type("/dev/shm") != "tmpfs":
        pytest.skip("this machine has no tmpfs at /dev/shm")
    seen = _spy_maps(monkeypatch)
    mem = Path("/dev/shm") / f"flashckpt-test-reader-{os.getpid()}"
    state = _state(1)
    try:
        # a clean close empties the memory tier once its steps are on disk: keep it here
        with flashckpt.Checkpointer(
            tmp_path / "root", memory_tier=mem, chunk_size=CHUNK, keep_memory_after_close=True
        ) as ck:
            ck.save(1, state)
        live = _zeroed(state)
        with flashckpt.Checkpointer(tmp_path / "root", memory_tier=mem) as ck:
            assert ck.restore(live) == 1
        assert _equal(state, live) and seen
        assert not LocalBackend(tmp_path / "root").in_memory
    finally:
        shutil.rmtree(mem, ignore_errors=True)


def _flip(path: Path, at: int = 100) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0xFF
    path.write_bytes(bytes(data))


def test_mapped_damaged_chunk_raises_with_the_live_state_untouched(tmp_path, mapped):
    """Regression: the memory tier's chunks were read into the live tensors and verified
    there, so a flipped byte in the last chunk left every other tensor overwritten ("partly
    overwritten"). A memory copy that no other tier backs is verified whole before the first
    copy."""
    state = _state()
    with flashckpt.Checkpointer(tmp_path, chunk_size=CHUNK) as ck:
        ck.save(1, state)
    big = CheckpointStore(LocalBackend(tmp_path)).load_manifest(1).tensors["big"]
    last = big.shards[0].extents[-1].chunk
    ref = CheckpointStore(LocalBackend(tmp_path)).load_manifest(1).chunks[last]
    _flip(tmp_path / chunk_path(ref.hash, ref.codec))
    live = _state(7)
    before = copy.deepcopy(live)
    with pytest.warns(RuntimeWarning, match="local copy failed"):
        with pytest.raises(CorruptCheckpointError) as err:
            flashckpt.restore(tmp_path, live, step=1)
    assert "partly overwritten" not in str(err.value)
    assert err.value.chunk == ref.hash
    assert _equal(before, live)


def _memory_and_disk(tmp_path: Path, state: dict) -> tuple[Path, Path]:
    """Step 1 of ``state`` in a memory tier (a plain directory made to count as in memory)
    and promoted to the disk tier: two copies of the same step."""
    root, mem = tmp_path / "root", tmp_path / "shm"
    with flashckpt.Checkpointer(
        root, memory_tier=mem, chunk_size=CHUNK, keep_memory_after_close=True
    ) as ck:
        ck.save(1, state)
    assert (root / "steps").is_dir() and any(_chunk_files(mem))
    return root, mem


def test_memory_tier_backed_by_a_disk_copy_is_read_in_one_pass(tmp_path, mapped):
    """Issue 26: with the same step on the disk as well, the memory tier is read straight into
    the live tensors, each piece hashed as it lands (no map, no verify-first pass)."""
    state = _state()
    root, mem = _memory_and_disk(tmp_path, state)
    live = _zeroed(state)
    with flashckpt.Checkpointer(root, memory_tier=mem, chunk_size=CHUNK) as ck:
        mapped.clear()  # promotion to the disk maps the tier's chunks: not the restore
        assert ck.restore(live) == 1
        assert mapped == []  # one pass: nothing was mapped and verified first


def test_one_pass_memory_damage_falls_back_to_the_disk_copy(tmp_path, mapped):
    """A flipped byte in the memory tier's copy, found after other tensors were overwritten:
    the disk copy of the same step is loaded over everything, so the step returned is whole."""
    state = _state()
    root, mem = _memory_and_disk(tmp_path, state)
    ref = _last_chunk_of(CheckpointStore(LocalBackend(mem)), "big")
    _flip(mem / chunk_path(ref.hash, ref.codec))
    live = _state(7)
    with pytest.warns(RuntimeWarning, match="memory copy failed"):
        with flashckpt.Checkpointer(root, memory_tier=mem, chunk_size=CHUNK) as ck:
            assert ck.restore(live) == 1
    assert _equal(state, live)


def test_one_pass_damage_in_every_copy_never_returns_none(tmp_path, mapped):
    """Both copies of the only step damaged: the live state was written, so the restore raises
    "partly overwritten" instead of returning None (a fresh start on half-loaded weights)."""
    state = _state()
    root, mem = _memory_and_disk(tmp_path, state)
    for where in (mem, root):
        ref = _last_chunk_of(CheckpointStore(LocalBackend(where)), "big")
        _flip(where / chunk_path(ref.hash, ref.codec))
    with pytest.warns(RuntimeWarning):
        with flashckpt.Checkpointer(root, memory_tier=mem, chunk_size=CHUNK) as ck:
            with pytest.raises(CorruptCheckpointError, match="partly overwritten"):
                ck.restore(_state(7))


def _last_chunk_of(store: CheckpointStore, key: str):
    m = store.load_manifest(1)
    return m.chunks[m.tensors[key].shards[0].extents[-1].chunk]


def test_chunk_read_hashes_each_piece_as_it_lands(tmp_path, monkeypatch):
    """read_chunk_into verifies while it reads: the hash sees every cache-sized piece right
    after its read, in order, and a flip in a middle piece is found."""
    monkeypatch.setattr(backend_mod, "EACH_PIECE", 4096)
    store = CheckpointStore(LocalBackend(tmp_path))
    data = os.urandom(5 * 4096 + 17)
    ref = store.put_chunk(hash_parts([data]), len(data), [data], "raw")
    pieces: list[int] = []
    real = LocalBackend.read_into

    def spy(self, path, out, *, each=None):
        def seen(piece):
            pieces.append(len(piece))
            assert each is not None
            each(piece)

        return real(self, path, out, each=seen)

    monkeypatch.setattr(LocalBackend, "read_into", spy)
    out = bytearray(len(data))
    store.read_chunk_into(ref, memoryview(out))
    assert bytes(out) == data and pieces == [4096] * 5 + [17]
    _flip(tmp_path / chunk_path(ref.hash, "raw"), at=2 * 4096 + 5)
    with pytest.raises(CorruptCheckpointError, match=ref.hash):
        store.read_chunk_into(ref, memoryview(bytearray(len(data))))


def _one_tensor_checkpoint(tmp_path: Path, n: int = 40000) -> tuple[CheckpointStore, Manifest]:
    with flashckpt.Checkpointer(tmp_path, chunk_size=CHUNK) as ck:
        ck.save(1, {"t": torch.arange(n, dtype=torch.float32)})
    store = CheckpointStore(LocalBackend(tmp_path))
    return store, store.load_manifest(1)


def _read(store: CheckpointStore, manifest: Manifest, dest: torch.Tensor) -> list:
    """read_plan of tensor "t" into ``dest``; returns the calls of before_write."""
    e = manifest.tensors["t"]
    plan = RestorePlan(state={}, trees={})
    plan.targets["t"] = Target(entry=e, dest=dest, offset=(0,), shape=e.global_shape, value=dest)
    calls: list = []
    with ThreadPoolExecutor(4) as ex:
        read_plan(store, manifest, plan, ex, before_write=lambda: calls.append(1))
    return calls


def test_mapped_chunk_truncated_after_the_size_check_is_refused_untouched(tmp_path, mapped):
    """The map is checked against the manifest's size before a byte is used: a chunk cut
    short after load's size check is damage, and nothing was copied."""
    store, m = _one_tensor_checkpoint(tmp_path)
    path = tmp_path / chunk_path(m.chunks[1].hash, "raw")
    os.truncate(path, 1000)
    dest = torch.full((40000,), -1.0)
    with pytest.raises(CorruptCheckpointError, match=m.chunks[1].hash):
        _read(store, m, dest)
    assert torch.equal(dest, torch.full((40000,), -1.0))


def test_disk_read_verifies_and_marks_the_first_write(tmp_path):
    store, m = _one_tensor_checkpoint(tmp_path)
    dest = torch.zeros(40000)
    assert _read(store, m, dest) == [1]
    assert torch.equal(dest, torch.arange(40000, dtype=torch.float32))
    _flip(tmp_path / chunk_path(m.chunks[0].hash, "raw"))
    with pytest.raises(CorruptCheckpointError, match=m.chunks[0].hash):
        _read(store, m, torch.zeros(40000))


@pytest.mark.parametrize("kind", ["symlink", "fifo", "directory"])
@pytest.mark.parametrize("maps", [True, False], ids=["mapped", "read"])
def test_non_regular_chunk_is_refused(tmp_path, monkeypatch, kind, maps):
    if maps:
        monkeypatch.setattr(LocalBackend, "in_memory", property(lambda self: True))
    store, m = _one_tensor_checkpoint(tmp_path / "root")
    path = tmp_path / "root" / chunk_path(m.chunks[0].hash, "raw")
    outside = tmp_path / "elsewhere.bin"
    shutil.move(path, outside)
    if kind == "symlink":
        path.symlink_to(outside)  # the same, valid bytes: still never followed
    elif kind == "fifo":
        os.mkfifo(path)
    else:
        path.mkdir()
    dest = torch.full((40000,), -1.0)
    with pytest.raises((CorruptCheckpointError, StorageError)):
        _read(store, m, dest)
    with pytest.raises((CorruptCheckpointError, StorageError)):
        store.backend.map(chunk_path(m.chunks[0].hash, "raw"))
    if maps:
        assert torch.equal(dest, torch.full((40000,), -1.0))
    live = {"t": torch.zeros(40000)}
    with pytest.warns(RuntimeWarning, match="unreadable|not a regular file|symlink"):
        with pytest.raises((CorruptCheckpointError, StorageError)):
            flashckpt.restore(tmp_path / "root", live, step=1)


def test_map_of_an_empty_file_and_filesystem_type(tmp_path):
    b = LocalBackend(tmp_path)
    b.put("steps/empty", [b""])
    assert b.map("steps/empty") is None
    b.put("steps/some", [b"abc"])
    mapped = b.map("steps/some")
    assert mapped is not None and bytes(mapped) == b"abc"
    mapped[0] = ord("x")  # a private map: the file never changes
    assert (tmp_path / "steps" / "some").read_bytes() == b"abc"
    assert filesystem_type("/proc") == "proc"
    assert filesystem_type("/proc/self") == "proc"


def test_read_into_in_pieces(tmp_path, monkeypatch):
    monkeypatch.setattr(backend_mod, "READ_PIECE", 4096)
    b = LocalBackend(tmp_path)
    data = os.urandom(3 * 4096 + 123)
    b.put("steps/blob", [data])
    out = bytearray(len(data) + 10)
    assert b.read_into("steps/blob", memoryview(out)) == len(data)
    assert bytes(out[: len(data)]) == data


# -- resharding: a hand-made manifest with two shards over three chunks ------------------------
def _sharded(tmp_path: Path, codec: str) -> tuple[CheckpointStore, Manifest, torch.Tensor]:
    """A 13x7 float32 tensor saved as rows 0-5 and 5-13. Chunk 0 holds 3 bytes of another
    tensor then all of shard 0 (so shard 0 starts at a byte offset no float view accepts);
    shard 1 is split over chunks 1 and 2."""
    full = torch.randn(13, 7, generator=torch.Generator().manual_seed(3))
    store = CheckpointStore(LocalBackend(tmp_path))
    s0, s1 = full[:5].contiguous(), full[5:].contiguous()
    b0 = b"\x01\x02\x03" + s0.numpy().tobytes()
    b1 = s1.numpy().tobytes()
    blobs = [b0, b1[:100], b1[100:]]
    refs = [
        store.put_chunk(hash_parts([b]), len(b), [b], choose_codec(codec, 4) if codec else "raw")
        for b in blobs
    ]
    shards = (
        Shard(offset=(0, 0), shape=(5, 7), extents=(Extent(chunk=0, offset=3, length=140),)),
        Shard(
            offset=(5, 0),
            shape=(8, 7),
            extents=(Extent(chunk=1, offset=0, length=100), Extent(chunk=2, offset=0, length=124)),
        ),
    )
    e = TensorEntry(key="t", kind="torch", dtype="float32", global_shape=(13, 7), shards=shards)
    return store, Manifest(step=1, time_s=0.0, tensors={"t": e}, chunks=refs), full


@pytest.mark.parametrize("codec", [None, "zstd"])
@pytest.mark.parametrize("maps", [True, False], ids=["mapped", "read"])
@pytest.mark.parametrize(
    "box", [((0, 0), (13, 7)), ((3, 0), (6, 7)), ((6, 2), (4, 5)), ((0, 3), (5, 2))]
)
def test_resharded_boxes(tmp_path, monkeypatch, codec, maps, box):
    if maps:
        monkeypatch.setattr(LocalBackend, "in_memory", property(lambda self: True))
    store, m, full = _sharded(tmp_path, codec)
    (r, c), (h, w) = box
    dest = torch.zeros(h, w)
    plan = RestorePlan(state={}, trees={})
    plan.targets["t"] = Target(entry=m.tensors["t"], dest=dest, offset=(r, c), shape=(h, w))
    with ThreadPoolExecutor(3) as ex:
        read_plan(store, m, plan, ex)
    assert torch.equal(dest, full[r : r + h, c : c + w])
    assert torch.equal(reader.read_tensors(store, m, ["t"])["t"], full)


class _CountingPool(ThreadPoolExecutor):
    def __init__(self) -> None:
        super().__init__(2)
        self.jobs = 0

    def submit(self, fn, /, *args, **kwargs):  # type: ignore[override]
        self.jobs += 1
        return super().submit(fn, *args, **kwargs)


@pytest.mark.parametrize("maps", [True, False], ids=["mapped", "read"])
def test_small_tensors_cost_one_job_per_chunk_not_per_tensor(tmp_path, monkeypatch, maps):
    """2,000 small tensors packed into a few chunks are copied out by one job per chunk (a
    future per tensor cost more than its copy: 65-72 us of CPU per tensor at 50k tensors)."""
    if maps:
        monkeypatch.setattr(LocalBackend, "in_memory", property(lambda self: True))
    state = {f"t{i}": torch.full((7,), float(i)) for i in range(2000)}
    with flashckpt.Checkpointer(tmp_path, chunk_size=CHUNK, incremental=False) as ck:
        ck.save(1, {"m": state})
    store = CheckpointStore(LocalBackend(tmp_path))
    manifest = store.load_manifest(1)
    live = {"m": {k: torch.zeros(7) for k in state}}
    from flashckpt.state.restore import plan_restore

    plan = plan_restore(live, manifest)
    with _CountingPool() as pool:
        loaded = read_plan(store, manifest, plan, pool)
    plan.finish(loaded)
    n_chunks = len(manifest.chunks)
    assert n_chunks < 10
    # mapped stores also map+verify each chunk once before copying: at most 2 jobs per chunk
    assert pool.jobs <= 2 * n_chunks
    assert all(torch.equal(live["m"][k], v) for k, v in state.items())
