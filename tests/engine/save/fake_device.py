"""An asynchronous stand-in for CUDA, on CPU, behind flashckpt.engine.device.OPS.

What it models (the CUDA semantics the device paths depend on):

* **Several devices per process.** A "device tensor" is a CPU tensor registered with
  :meth:`FakeDevice.on` ("cuda:N"); ``device_of`` answers from that registry (by storage), and
  everything else is "cpu" (unless ``default_device`` names a device, the old stand-in's rule).
* **A current device per thread** (:meth:`device`), which can differ from a tensor's.
* **Streams that complete later.** Every fake stream has a worker thread; copies and kernels
  issued on it run there in order, each after ``delay_s``. Each device has a default stream;
  each thread has a current stream per device (:meth:`use`).
* **Copies.** ``Tensor.copy_`` is patched while installed: a copy that touches a device
  tensor is issued on the calling thread's current stream *of that tensor's device* (as
  CUDA's copy kernels are), returns at once when ``non_blocking=True``, and waits for that
  stream otherwise. The N-th such copy can be made to raise (``fail_copy_at``).
* **Events** complete only when the work recorded before them on their stream has.
* **Contexts**: the set of devices anything was done on (events, streams, copies, pins).
* **Per-stream allocator**: streams created per device, and per stream the peak bytes that
  device work run on it (:meth:`run`: fingerprints) held in fresh allocations at once
  (``FakeStream.peak_alloc_bytes``, measured by :class:`PeakAlloc`), which is what the caching
  allocator keeps cached for that stream afterwards.
* **Pinned memory**: ``torch.empty(pin_memory=True)`` and :meth:`pin` are accounted as torch's
  caching host allocator does (each block a power of two; a freed block stays cached, and is
  reused, until :meth:`empty_host_cache`), with the peak and the largest single pin.
"""

from __future__ import annotations

import queue
import threading
import time
import weakref
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

PAGE = 4096


class PeakAlloc(TorchDispatchMode):
    """Peak bytes of tensors allocated (not views, not in-place results) and alive at once."""

    def __init__(self) -> None:
        super().__init__()
        self.now = 0
        self.peak = 0

    def _free(self, n: int) -> None:
        self.now -= n

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        ins = {
            a.untyped_storage().data_ptr()
            for a in tree_flatten((args, kwargs))[0]
            if isinstance(a, torch.Tensor)
        }
        for o in tree_flatten(out)[0]:
            fresh = isinstance(o, torch.Tensor) and o._base is None
            if fresh and o.untyped_storage().data_ptr() not in ins:
                n = o.untyped_storage().nbytes()
                self.now += n
                self.peak = max(self.peak, self.now)
                weakref.finalize(o, self._free, n)
        return out


def _index(device: Any) -> int | None:
    if device is None:
        return None
    if isinstance(device, int):
        return device
    d = torch.device(device)
    if d.type == "cpu":
        return None
    return 0 if d.index is None else d.index


class FakeEvent:
    def __init__(self, device: int) -> None:
        self.device = device
        self.done = threading.Event()

    def synchronize(self) -> None:
        self.done.wait()

    def query(self) -> bool:
        return self.done.is_set()


class FakeStream:
    def __init__(self, fake: FakeDevice, device: int, name: str) -> None:
        self.fake = fake
        self.device = device
        self.name = name
        self._q: queue.Queue[tuple[Callable[[], Any], float, Future[Any]] | None] = queue.Queue()
        self._cond = threading.Condition()
        self._pending = 0
        self.peak_alloc_bytes = 0  # see PeakAlloc: what this stream's allocator pool keeps
        self._thread = threading.Thread(target=self._work, name=f"fake-{name}", daemon=True)
        self._thread.start()

    def __repr__(self) -> str:
        return f"FakeStream({self.name})"

    def enqueue(
        self, fn: Callable[[], Any], delay_s: float = 0.0, *, measure: bool = False
    ) -> Future[Any]:
        fut: Future[Any] = Future()
        fut.measured = measure  # type: ignore[attr-defined]
        with self._cond:
            self._pending += 1
        self._q.put((fn, delay_s, fut))
        return fut

    @property
    def pending(self) -> int:
        with self._cond:
            return self._pending

    def _work(self) -> None:
        self.fake._local.worker = self
        while True:
            job = self._q.get()
            if job is None:
                return
            fn, delay_s, fut = job
            if delay_s:
                time.sleep(delay_s)
            try:
                if getattr(fut, "measured", False):
                    with PeakAlloc() as peak:
                        result = fn()
                    self.peak_alloc_bytes = max(self.peak_alloc_bytes, peak.peak)
                    fut.set_result(result)
                else:
                    fut.set_result(fn())
            except BaseException as exc:  # a device error: surfaces at the next sync
                fut.set_exception(exc)
                self.fake.errors.append(exc)
            del job, fn, fut  # (a finished copy holds no tensor: pinned accounting)
            with self._cond:
                self._pending -= 1
                self._cond.notify_all()

    # -- the torch.cuda.Stream methods the engine may call ------------------------------------
    def wait_event(self, event: FakeEvent) -> None:
        self.enqueue(event.done.wait)

    def synchronize(self) -> None:
        with self._cond:
            while self._pending:
                self._cond.wait()

    def stop(self) -> None:
        self._q.put(None)


class FakeDevice:
    """The stand-in (a DeviceOps); ``install(monkeypatch)`` makes it :data:`device.OPS`."""

    def __init__(
        self, *, delay_s: float = 0.02, default_device: str | None = None, pinnable: bool = True
    ) -> None:
        self.delay_s = delay_s
        self.default_device = default_device
        self.pinnable = pinnable
        self._local = threading.local()
        self._where: dict[int, int] = {}  # storage pointer -> device index
        self._keep: list[torch.Tensor] = []  # registered tensors stay alive (no pointer reuse)
        self._defaults: dict[int, FakeStream] = {}
        self._lock = threading.RLock()
        self.streams: list[FakeStream] = []
        self.streams_created: Counter[int] = Counter()  # side streams made per device
        self.contexts: set[int] = set()
        self.errors: list[BaseException] = []
        self.copies = 0  # copies that touched a device tensor
        self.fail_copy_at: int | None = None  # the copy (1-based) that raises
        # pinned memory, as torch's caching host allocator holds it
        self._pinned_ptrs: set[int] = set()
        self._pinned_live: dict[int, int] = {}  # id of a block -> its (power of two) size
        self._pinned_cached: list[int] = []  # sizes of freed blocks kept by the cache
        self.pinned_peak_bytes = 0
        self.largest_pin_bytes = 0
        # host memory page-locked by cudaHostRegister: start pointer -> bytes
        self._registered: dict[int, int] = {}
        self.registers = 0  # cudaHostRegister calls
        self.fail_register_at: int | None = None  # the call (1-based) that fails
        self.pin_threads: list[str] = []
        self._real_copy: Any = None
        self._real_empty: Any = None
        self._real_is_pinned: Any = None

    # -- setup --------------------------------------------------------------------------------
    def install(self, monkeypatch: Any) -> FakeDevice:
        from flashckpt.engine import device

        monkeypatch.setattr(device, "OPS", self)
        self._real_copy = torch.Tensor.copy_
        self._real_empty = torch.empty
        self._real_is_pinned = torch.Tensor.is_pinned
        fake = self

        def copy_(dst: torch.Tensor, src: Any, non_blocking: bool = False) -> torch.Tensor:
            return fake._copy(dst, src, non_blocking)

        def empty(*args: Any, **kwargs: Any) -> torch.Tensor:
            if kwargs.pop("pin_memory", False):  # what torch's pinned allocator would do
                return fake._pin_like_torch(args, kwargs)
            return fake._real_empty(*args, **kwargs)

        def is_pinned(t: torch.Tensor, *a: Any) -> bool:
            return fake.is_pinned(t)

        monkeypatch.setattr(torch.Tensor, "copy_", copy_)
        monkeypatch.setattr(torch, "empty", empty)
        monkeypatch.setattr(torch.Tensor, "is_pinned", is_pinned)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: self.pinnable)
        return self

    def close(self) -> None:
        for s in [*self.streams, *self._defaults.values()]:
            s.synchronize()
            s.stop()

    # -- tensors and devices -------------------------------------------------------------------
    def on(self, t: torch.Tensor, device: str) -> torch.Tensor:
        """Register ``t`` (and its views) as living on ``device``."""
        idx = _index(device)
        assert idx is not None
        with self._lock:
            self._where[t.untyped_storage().data_ptr()] = idx
            self._keep.append(t)
            self.contexts.add(idx)
        return t

    def where(self, t: torch.Tensor) -> int | None:
        if not isinstance(t, torch.Tensor) or t.device.type != "cpu":
            return None
        idx = self._where.get(t.untyped_storage().data_ptr())
        if idx is None and self.default_device is not None:
            return _index(self.default_device)
        return idx

    def current_device(self) -> int:
        return getattr(self._local, "device", 0)

    @contextmanager
    def device(self, device: Any) -> Iterator[None]:
        """``torch.cuda.device``: the calling thread's current device."""
        prev = self.current_device()
        self._local.device = _index(device)
        try:
            yield
        finally:
            self._local.device = prev

    def default_stream(self, idx: int) -> FakeStream:
        with self._lock:
            s = self._defaults.get(idx)
            if s is None:
                s = self._defaults[idx] = FakeStream(self, idx, f"default:{idx}")
            return s

    def _current(self, idx: int) -> FakeStream:
        cur: dict[int, FakeStream] = getattr(self._local, "streams", {})
        return cur.get(idx) or self.default_stream(idx)

    def launch(self, fn: Callable[[], Any], device: str, delay_s: float | None = None) -> None:
        """A kernel on ``device``'s current stream of this thread (the user's training work)."""
        idx = _index(device)
        assert idx is not None
        self.contexts.add(idx)
        self._current(idx).enqueue(fn, self.delay_s if delay_s is None else delay_s)

    def pending(self) -> int:
        return sum(s.pending for s in [*self.streams, *self._defaults.values()])

    def synchronize_all(self) -> None:
        for s in [*self.streams, *self._defaults.values()]:
            s.synchronize()

    # -- copies --------------------------------------------------------------------------------
    def _copy(self, dst: torch.Tensor, src: Any, non_blocking: bool) -> torch.Tensor:
        real = self._real_copy
        devs = {d for d in (self.where(dst), self.where(src)) if d is not None}
        if not devs or getattr(self._local, "worker", None) is not None:
            return real(dst, src, non_blocking)  # host only, or already on a device worker
        with self._lock:
            self.copies += 1
            n = self.copies
        if self.fail_copy_at is not None and n == self.fail_copy_at:
            raise RuntimeError(f"CUDA error: injected failure of copy {n}")
        idx = self.where(dst) if self.where(dst) is not None else self.where(src)
        assert idx is not None
        self.contexts.add(idx)
        stream = self._current(idx)
        stream.enqueue(lambda: real(dst, src), self.delay_s)
        if not non_blocking:
            stream.synchronize()
        return dst

    # -- DeviceOps -----------------------------------------------------------------------------
    def device_of(self, t: torch.Tensor) -> str:
        idx = self.where(t)
        return "cpu" if idx is None else f"cuda:{idx}"

    def available(self) -> bool:
        return self.pinnable

    def has_context(self) -> bool:
        return bool(self.contexts)

    def active_devices(self) -> list[str]:
        return [f"cuda:{i}" for i in sorted(self.contexts)]

    def event(self, device: Any = None) -> FakeEvent:
        # torch.cuda.Event().record(): the current device's current stream when none is named
        idx = _index(device)
        idx = self.current_device() if idx is None else idx
        self.contexts.add(idx)
        ev = FakeEvent(idx)
        self._current(idx).enqueue(ev.done.set)
        return ev

    def host_wait(self, event: FakeEvent) -> None:
        event.done.wait()

    def stream(self, device: Any) -> FakeStream:
        idx = _index(device)
        idx = self.current_device() if idx is None else idx
        self.contexts.add(idx)
        with self._lock:
            self.streams_created[idx] += 1
            s = FakeStream(self, idx, f"side:{idx}:{self.streams_created[idx]}")
            self.streams.append(s)
        return s

    def current_stream(self, device: Any) -> FakeStream:
        idx = _index(device)
        return self._current(self.current_device() if idx is None else idx)

    def wait(self, stream: FakeStream, event: FakeEvent) -> None:
        stream.wait_event(event)

    @contextmanager
    def use(self, stream: FakeStream) -> Iterator[None]:
        """``torch.cuda.stream``: current stream of its device (and that device current)."""
        cur: dict[int, FakeStream] = getattr(self._local, "streams", {})
        prev = cur.get(stream.device)
        self._local.streams = {**cur, stream.device: stream}
        try:
            with self.device(stream.device):
                yield
        finally:
            restored = dict(self._local.streams)
            if prev is None:
                restored.pop(stream.device, None)
            else:
                restored[stream.device] = prev
            self._local.streams = restored

    def run(self, stream: FakeStream, fn: Callable[[], Any]) -> Any:
        return stream.enqueue(fn, measure=True).result()

    def synchronize(self, stream: FakeStream) -> None:
        stream.synchronize()

    # -- pinned memory -------------------------------------------------------------------------
    @property
    def pinned_bytes(self) -> int:
        return sum(self._pinned_live.values()) + sum(self._pinned_cached) + self.registered_bytes

    @property
    def registered_bytes(self) -> int:
        return sum(self._registered.values())

    def register(self, t: torch.Tensor, device: Any) -> None:
        """cudaHostRegister: page-lock ``t``'s bytes (needs a context, like the real call)."""
        if not self.pinnable:
            raise RuntimeError("no pinned memory on this host (fake)")
        idx = _index(device)
        nbytes = t.numel() * t.element_size()
        with self._lock:
            self.registers += 1
            if self.registers == self.fail_register_at:
                raise RuntimeError("cudaHostRegister: out of memory (fake)")
            ptr = t.data_ptr()
            end = ptr + nbytes
            for start, n in self._registered.items():  # the real call refuses an overlap
                assert end <= start or ptr >= start + n, "registered twice"
            self.contexts.add(self._pin_device() if idx is None else idx)
            self.pin_threads.append(threading.current_thread().name)
            self._registered[ptr] = nbytes
            self.largest_pin_bytes = max(self.largest_pin_bytes, nbytes)
            self.pinned_peak_bytes = max(self.pinned_peak_bytes, self.pinned_bytes)

    def unregister(self, t: torch.Tensor) -> None:
        with self._lock:
            if self._registered.pop(t.data_ptr(), None) is None:
                raise RuntimeError("cudaHostUnregister: not registered (fake)")

    def _pin_device(self) -> int:
        """torch's pinned allocator: a device with a context when one has, else the current."""
        return min(self.contexts) if self.contexts else self.current_device()

    def _pin_like_torch(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor:
        t = self._real_empty(*args, **kwargs)
        out = self._pin(t.numel() * t.element_size(), self._pin_device())
        return out.view(t.dtype)[: t.numel()].view(t.shape)

    def _pin(self, nbytes: int, idx: int) -> torch.Tensor:
        if not self.pinnable:
            raise RuntimeError("no pinned memory on this host (fake)")
        size = 1 << max(nbytes - 1, 0).bit_length()
        with self._lock:
            self.contexts.add(idx)  # cudaHostAlloc needs a context
            self.pin_threads.append(threading.current_thread().name)
            fits = sorted(s for s in self._pinned_cached if s >= size)
            if fits:
                self._pinned_cached.remove(fits[0])
                size = fits[0]
            else:
                self.largest_pin_bytes = max(self.largest_pin_bytes, size)
        raw = self._real_empty(nbytes + PAGE, dtype=torch.uint8)
        skip = -raw.data_ptr() % PAGE
        out = raw[skip : skip + nbytes]
        storage = raw.untyped_storage()  # lives while any view (or numpy array) of it does
        key, ptr = id(storage), storage.data_ptr()
        with self._lock:
            self._pinned_live[key] = size
            self._pinned_ptrs.add(ptr)
            self.pinned_peak_bytes = max(self.pinned_peak_bytes, self.pinned_bytes)
        weakref.finalize(storage, self._unpin, key, ptr)
        return out

    def _unpin(self, key: int, ptr: int) -> None:
        with self._lock:
            size = self._pinned_live.pop(key, 0)
            self._pinned_ptrs.discard(ptr)
            if size:
                self._pinned_cached.append(size)

    def is_pinned(self, t: torch.Tensor) -> bool:
        ptr = t.untyped_storage().data_ptr()
        if ptr in self._pinned_ptrs:
            return True
        with self._lock:  # cudaPointerGetAttributes: inside a registered range
            return any(start <= ptr < start + n for start, n in self._registered.items())

    def empty_host_cache(self) -> None:
        with self._lock:
            self._pinned_cached.clear()

    def pinned_tensor(self, n: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """A pinned host tensor of ``n`` elements (the user's D2H target)."""
        raw = self._pin(n * torch.tensor([], dtype=dtype).element_size(), self.current_device())
        t = raw.view(dtype)
        t.zero_()
        self._keep.append(t)
        return t
