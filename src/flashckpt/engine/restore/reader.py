"""Restore reads: fetch verified chunks in parallel and scatter them into target tensors.

A chunk's verified bytes come one of two ways, chosen per store:

* **read** (disk, remote, and the memory tier when another tier holds the same step). A raw
  chunk that is exactly one contiguous piece of a CPU target is read straight into the
  target's memory and verified there in one pass (``CheckpointStore.read_chunk_into``: each
  cache-sized piece is hashed right after the read put it there); any other raw chunk is read
  into one scratch buffer (``readinto``, no ``bytes`` object), verified, and copied out. A
  damaged chunk is found after bytes reached the live state: the restore then loads the other
  tier's copy of the step, which overwrites every tensor (engine/restore/load.py).
* **mapped** (the memory tier when it holds the only copy of the step, ``backed=False``).
  Every raw chunk the plan needs is mapped and hashed in parallel (``CheckpointStore.map_chunk``;
  xxh3 releases the GIL) *before* any byte reaches the live state, then copied from the map
  into the targets: two passes instead of one (on a tmpfs the kernel's per-page cost bounds
  both at about the same speed per thread), and a damaged raw chunk raises with the live state
  untouched, since no other copy could make it whole again.

Compressed chunks are decoded into scratch and verified before their bytes are copied.
``before_write`` is called once, just before the first byte can reach a target (after the
mapped pass; before the first read otherwise): the restore path (engine/restore/load.py) records
there that the live state is being written.

Each chunk is read and verified once, however many tensors it hold (a use count drops it after
its last use). A target shard covering a different box than a saved shard (resharding) reads
only the byte span of the saved shard that contains the overlap (a view of the chunk when the
span lies in one chunk), then copies the box. Targets that are not host tensors
(``engine.device``: CUDA) always take that copy path, from verified host bytes, on the stream
that was current for the target's device on the thread that called restore (the user's
stream), so the copies land after the work the user queued there and before the work they
queue next; the reader threads' own default streams are never used.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from concurrent.futures import Executor, Future
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np
import torch

from flashckpt.engine import device
from flashckpt.state.restore import RestorePlan, Target
from flashckpt.store.format.dtypes import numpy_dtype, torch_dtype
from flashckpt.store.format.manifest import ChunkRef, Extent, Manifest, Shard, check_allocatable
from flashckpt.store.store import CheckpointStore, maps_chunks


class _ChunkCache:
    """Read-once cache with use counts: a chunk is dropped after its last use."""

    def __init__(self, store: CheckpointStore, step: int, *, backed: bool) -> None:
        self.store = store
        self.step = step
        self.mapped = maps_chunks(store) and not backed
        self._futs: dict[str, Future[torch.Tensor]] = {}
        self._uses: dict[str, int] = {}
        self._refs: dict[str, tuple[ChunkRef, str]] = {}
        self._lock = threading.Lock()

    def expect(self, ref: ChunkRef, key: str) -> None:
        self._uses[ref.hash] = self._uses.get(ref.hash, 0) + 1
        self._refs.setdefault(ref.hash, (ref, key))

    def verify_mapped(self, workers: Executor) -> None:
        """Mapped stores: map and verify every raw chunk expected, in parallel. Raises the
        first damage found, once every chunk was tried (nothing has been copied yet)."""
        if not self.mapped:
            return
        raw = [(ref, key) for ref, key in self._refs.values() if ref.codec == "raw"]
        futs = [workers.submit(self._fill, ref, key) for ref, key in raw]
        errors = [f.exception() for f in [fut.result() for fut in futs]]
        first = next((e for e in errors if e is not None), None)
        if first is not None:
            raise first

    def _fill(self, ref: ChunkRef, key: str) -> Future[torch.Tensor]:
        """The future of ``ref``'s verified bytes, loading them if no one has."""
        with self._lock:
            fut = self._futs.get(ref.hash)
            owner = fut is None
            if fut is None:
                fut = self._futs[ref.hash] = Future()
        if owner:
            try:
                fut.set_result(self._load(ref, key))
            except BaseException as exc:
                fut.set_exception(exc)
        return fut

    def _load(self, ref: ChunkRef, key: str) -> torch.Tensor:
        store, step = self.store, self.step
        if self.mapped and ref.codec == "raw":
            mapped = store.map_chunk(ref, step=step, key=key)
            return _as_bytes(mapped)
        if ref.codec == "raw":
            out = torch.empty(ref.size, dtype=torch.uint8)
            store.read_chunk_into(ref, memoryview(out.numpy()), step=step, key=key)  # type: ignore[arg-type]
            return out
        return _as_bytes(bytearray(store.read_chunk(ref, step=step, key=key)))

    def get(self, ref: ChunkRef, key: str) -> torch.Tensor:
        """The chunk's verified bytes as a uint8 tensor; counts one use."""
        fut = self._fill(ref, key)
        try:
            return fut.result()
        finally:
            self.release(ref.hash)

    def release(self, h: str) -> None:
        """Count one use of ``h`` that did not need its bytes."""
        with self._lock:
            self._uses[h] = self._uses.get(h, 1) - 1
            if self._uses[h] <= 0:
                self._futs.pop(h, None)


def _as_bytes(buf: Any) -> torch.Tensor:
    """A uint8 tensor over a writable buffer (no copy)."""
    if not len(buf):
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(buf, dtype=torch.uint8)


@dataclass(kw_only=True)
class _Task:
    target: Target
    shard: Shard
    dest: torch.Tensor  # typed, CPU or device, of target.shape
    stream: Any = None  # a device target: the caller's current stream of its device


def read_plan(
    store: CheckpointStore,
    manifest: Manifest,
    plan: RestorePlan,
    workers: Executor,
    *,
    before_write: Callable[[], None] | None = None,
    backed: bool = False,
) -> dict[str, Any]:
    """Read every planned tensor; returns ``{key: value for load_state_dict}``. ``backed``:
    another tier holds this step too, so a memory tier is read in one pass (see above).

    The work is one job per chunk, not per tensor: a chunk holding 10,000 small tensors is
    fetched and verified once and its pieces copied out in one loop (a future per tensor cost
    more than the copy). Resharded and device targets keep one job per shard (their boxes
    span chunks)."""
    cache = _ChunkCache(store, manifest.step, backed=backed)
    pieces: dict[int, list[tuple[Extent, np.ndarray, str]]] = {}
    direct: list[tuple[ChunkRef, np.ndarray, str]] = []
    boxes: list[_Task] = []
    loaded: dict[str, Any] = {}
    ops = device.current()
    streams: dict[str, Any] = {}  # device -> this (the caller's) thread's current stream
    for key, target in plan.targets.items():
        dest, value = _destination(target)
        loaded[key] = value
        entry = target.entry
        where = ops.device_of(dest)
        stream = None
        if where != "cpu":
            stream = streams.get(where)
            if stream is None:
                stream = streams[where] = ops.current_stream(where)
        dest_bytes = _byte_view(dest) if where == "cpu" else None
        dtype_ok = entry.kind == "numpy" or dest.dtype == torch_dtype(entry.dtype)
        for shard in entry.shards:
            same_box = shard.offset == target.offset and shard.shape == target.shape
            if not same_box and _overlap(shard, target) is None:
                continue
            if not (same_box and dest_bytes is not None and dtype_ok):
                for ext in shard.extents:
                    cache.expect(manifest.chunks[ext.chunk], key)
                boxes.append(_Task(target=target, shard=shard, dest=dest, stream=stream))
                continue
            pos = 0
            for ext in shard.extents:
                ref = manifest.chunks[ext.chunk]
                out = dest_bytes[pos : pos + ext.length]
                pos += ext.length
                whole = ref.codec == "raw" and ext.offset == 0 and ext.length == ref.size
                if whole and not cache.mapped:
                    direct.append((ref, out, key))
                    continue
                group = pieces.get(ext.chunk)
                if group is None:
                    group = pieces[ext.chunk] = []
                    cache.expect(ref, key)
                group.append((ext, out, key))
    cache.verify_mapped(workers)
    if before_write is not None:
        before_write()
    # largest chunks first: the readers then end together instead of one finishing a 32 MiB
    # chunk alone while the others are idle (on the memory tier the reads are CPU-bound)
    jobs: list[tuple[int, Callable[[], None]]] = [
        (ref.size, partial(_read_direct, cache, ref, out, key)) for ref, out, key in direct
    ]
    jobs += [
        (manifest.chunks[c].size, partial(_copy_pieces, cache, manifest.chunks[c], g))
        for c, g in pieces.items()
    ]
    jobs.sort(key=lambda job: -job[0])
    futs = [workers.submit(job) for _, job in jobs]
    futs += [workers.submit(_copy_box, task, manifest, cache) for task in boxes]
    for f in futs:
        f.result()
    return loaded


def _read_direct(cache: _ChunkCache, ref: ChunkRef, out: np.ndarray, key: str) -> None:
    """A raw chunk that is exactly one contiguous piece of a host target: read into it."""
    cache.store.read_chunk_into(ref, memoryview(out), step=cache.step, key=key)  # type: ignore[arg-type]


def _copy_pieces(
    cache: _ChunkCache, ref: ChunkRef, group: list[tuple[Extent, np.ndarray, str]]
) -> None:
    """Every piece of one chunk that lands in host targets, from one fetch of its bytes
    (numpy's copy is a plain memcpy, about 1.4x the bytes per second of ``Tensor.copy_``
    here, and releases the GIL)."""
    data = cache.get(ref, group[0][2]).numpy()
    for ext, out, _ in group:
        np.copyto(out, data[ext.offset : ext.offset + ext.length])


def _destination(target: Target) -> tuple[torch.Tensor, Any]:
    entry = target.entry
    if target.dest is not None:
        return target.dest, target.value
    check_allocatable(entry, target.shape)
    if entry.kind == "numpy":
        arr = np.empty(target.shape, dtype=numpy_dtype(entry.dtype))
        flat = torch.from_numpy(arr.reshape(-1).view(np.uint8))
        return flat, arr
    t = torch.empty(target.shape, dtype=torch_dtype(entry.dtype))
    return t, t


def _byte_view(t: torch.Tensor) -> np.ndarray | None:
    """Flat uint8 NumPy view of a contiguous host tensor, else None. NumPy slices and views
    cost a tenth of torch's (2-3 us each: most of a small tensor's restore); torch views
    only for the dtypes NumPy lacks (bfloat16, float8)."""
    if not t.is_contiguous():
        return None
    if t.dtype in _NUMPY_DTYPES:
        a = t.numpy()
        return (a if a.ndim == 1 else a.reshape(-1)).view(np.uint8)
    return t.reshape(-1).view(torch.uint8).numpy()


_NUMPY_DTYPES = {
    torch.float64, torch.float32, torch.float16, torch.int64, torch.int32, torch.int16,
    torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128,
}  # fmt: skip


def _overlap(shard: Shard, t: Target) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    lo = tuple(max(a, b) for a, b in zip(shard.offset, t.offset))
    hi = tuple(
        min(a + n, b + m) for a, n, b, m in zip(shard.offset, shard.shape, t.offset, t.shape)
    )
    if lo and any(top <= bot for top, bot in zip(hi, lo)):
        return None
    return lo, tuple(top - bot for top, bot in zip(hi, lo))


def _copy_box(task: _Task, manifest: Manifest, cache: _ChunkCache) -> None:
    """Copy the overlap of a saved shard and the target box (general resharding path)."""
    t, shard = task.target, task.shard
    ov = _overlap(shard, t)
    if ov is None:
        return
    lo, size = ov
    dtype = torch_dtype(t.entry.dtype) if t.entry.kind == "torch" else torch.uint8
    isz = t.entry.itemsize
    strides = _contiguous_strides(shard.shape)
    local_lo = [a - b for a, b in zip(lo, shard.offset)]
    first = sum(i * s for i, s in zip(local_lo, strides))
    last = sum((i + n - 1) * s for i, n, s in zip(local_lo, size, strides)) if size else first
    span = _read_span(task, manifest, cache, first * isz, (last + 1) * isz)
    if t.entry.kind == "numpy":
        src = span.view(-1)
        task.dest.copy_(src)  # numpy targets are always whole-array
        return
    src = span.view(dtype).as_strided(size, strides)
    box = tuple(slice(a - b, a - b + n) for a, b, n in zip(lo, t.offset, size))
    if task.stream is None:
        task.dest[box].copy_(src)
        return
    ops = device.current()
    with ops.use(task.stream):  # ordered with the user's work on their stream
        task.dest[box].copy_(src)
    ops.synchronize(task.stream)  # ``src`` may be dropped once this returns


def _read_span(
    task: _Task, manifest: Manifest, cache: _ChunkCache, start: int, end: int
) -> torch.Tensor:
    """Bytes ``start:end`` of the saved shard: a view of its chunk when one chunk holds them
    at an offset the dtype can be viewed at, else a copy assembled from the chunks."""
    pieces: list[tuple[int, torch.Tensor]] = []
    pos = 0
    for ext in task.shard.extents:
        ref = manifest.chunks[ext.chunk]
        a, b = max(pos, start), min(pos + ext.length, end)
        if a < b:
            data = cache.get(ref, task.target.entry.key)
            pieces.append((a - start, data[ext.offset + a - pos : ext.offset + b - pos]))
        else:
            cache.release(ref.hash)
        pos += ext.length
    if len(pieces) == 1 and pieces[0][1].numel() == end - start:
        view = pieces[0][1]
        if view.storage_offset() % task.target.entry.itemsize == 0:
            return view
    out = torch.empty(end - start, dtype=torch.uint8)
    for at, piece in pieces:
        out[at : at + piece.numel()].copy_(piece)
    return out


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides = []
    acc = 1
    for d in reversed(shape):
        strides.append(acc)
        acc *= max(d, 1)
    return tuple(reversed(strides))


def read_tensors(
    store: CheckpointStore, manifest: Manifest, keys: Iterable[str], *, workers: int = 4
) -> dict[str, Any]:
    """Whole tensors (shards merged) for ``keys``, on CPU: for export, diff and tools."""
    from concurrent.futures import ThreadPoolExecutor

    plan = RestorePlan(state={}, trees={})
    for key in keys:
        e = manifest.tensors[key]
        plan.targets[key] = Target(
            entry=e, dest=None, offset=(0,) * len(e.global_shape), shape=e.global_shape
        )
    with ThreadPoolExecutor(workers, thread_name_prefix="flashckpt-read") as ex:
        return read_plan(store, manifest, plan, ex)
