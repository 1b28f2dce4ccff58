"""The accelerator calls the save and restore paths make, behind one small object.

Staging device tensors needs a handful of CUDA calls: is CUDA usable (to pin the staging
arena), an event recorded on each device's training stream at ``save()``, a side stream per
device that waits for its own device's event, a context that makes it current, and the device
of each tensor. They all go through :class:`DeviceOps`, so the device-staging logic
(fingerprints, streams, events, the copies into the pool) is one code path, and a test runs it
on CPU by swapping :data:`OPS` for a stand-in whose copies and kernels complete later, on a
worker per fake stream (tests/engine/save/fake_device.py). That is the one seam: engine code
never calls ``torch.cuda`` for staging or restore copies itself.

Contract of a ``DeviceOps`` (``device`` arguments are strings such as ``"cuda:1"``):

1. ``device_of(tensor)`` names the device a tensor's bytes live on ("cpu" stages through the
   CPU path; anything else through the device path). Never the current device.
2. ``available()``: True when pinned host memory can be allocated. ``has_context()``: True
   when this process has a CUDA context on some device already; ``active_devices()`` those
   devices. Neither creates one.
3. ``event(device)`` returns an event recorded on ``device``'s current stream, made under
   ``torch.cuda.device(device)`` (no context lands on another GPU); ``host_wait(event)``
   blocks the calling thread until the work recorded before it has completed.
4. ``stream(device)`` a new side stream on ``device``; ``current_stream(device)`` the calling
   thread's current stream there; ``wait(stream, event)`` orders the stream after the event;
   ``use(stream)`` a context manager that makes the stream (and its device) current for the
   copies issued inside it; ``run(stream, fn)`` runs device work (a fingerprint) on the stream
   and returns its host result; ``synchronize(stream)`` waits until the work issued on it so
   far has completed.
5. ``register(tensor, device)`` page-locks a contiguous host tensor's bytes (``device``: where
   the context it needs lives, None for one that exists already; raises RuntimeError when it
   cannot), ``unregister(tensor)`` unlocks them, and ``is_pinned(tensor)``.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, ExitStack, nullcontext
from typing import Any, Protocol, TypeVar

import torch

T = TypeVar("T")


class DeviceOps(Protocol):
    def device_of(self, t: torch.Tensor) -> str: ...
    def available(self) -> bool: ...
    def has_context(self) -> bool: ...
    def active_devices(self) -> list[str]: ...
    def event(self, device: str) -> Any: ...
    def host_wait(self, event: Any) -> None: ...
    def stream(self, device: str) -> Any: ...
    def current_stream(self, device: str) -> Any: ...
    def wait(self, stream: Any, event: Any) -> None: ...
    def use(self, stream: Any) -> AbstractContextManager[Any]: ...
    def run(self, stream: Any, fn: Callable[[], T]) -> T: ...
    def synchronize(self, stream: Any) -> None: ...
    def register(self, t: torch.Tensor, device: str | None) -> None: ...
    def unregister(self, t: torch.Tensor) -> None: ...
    def is_pinned(self, t: torch.Tensor) -> bool: ...


class CudaOps:
    """The real calls (``torch.cuda``)."""

    def device_of(self, t: torch.Tensor) -> str:
        return "cpu" if t.is_cpu else str(t.device)  # is_cpu: a third of str() (per tensor)

    def available(self) -> bool:
        return torch.cuda.is_available()

    def active_devices(self) -> list[str]:
        if not torch.cuda.is_available() or not torch.cuda.is_initialized():
            return []
        has = getattr(torch._C, "_cuda_hasPrimaryContext", None)
        if has is None:  # (an older build: the current device, whose context init made)
            return [f"cuda:{torch.cuda.current_device()}"]
        return [f"cuda:{i}" for i in range(torch.cuda.device_count()) if has(i)]

    def has_context(self) -> bool:
        return bool(self.active_devices())

    def event(self, device: str) -> Any:
        with torch.cuda.device(device):
            ev = torch.cuda.Event()
            ev.record(torch.cuda.current_stream(device))
        return ev

    def host_wait(self, event: Any) -> None:
        event.synchronize()

    def stream(self, device: str) -> Any:
        with torch.cuda.device(device):
            return torch.cuda.Stream(device=device)

    def current_stream(self, device: str) -> Any:
        return torch.cuda.current_stream(device)

    def wait(self, stream: Any, event: Any) -> None:
        stream.wait_event(event)

    def use(self, stream: Any) -> AbstractContextManager[Any]:
        stack = ExitStack()
        stack.enter_context(torch.cuda.device(stream.device))
        stack.enter_context(torch.cuda.stream(stream))
        return stack

    def run(self, stream: Any, fn: Callable[[], T]) -> T:
        with self.use(stream):
            return fn()

    def synchronize(self, stream: Any) -> None:
        stream.synchronize()

    def register(self, t: torch.Tensor, device: str | None) -> None:
        # cudaHostRegister needs a context: under ``device`` when none exists yet (never the
        # current device, GPU 0, of another rank's GPU)
        try:
            with torch.cuda.device(device) if device is not None else nullcontext():
                nbytes = t.numel() * t.element_size()
                err = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), nbytes, 0)
        except (AssertionError, AttributeError) as exc:  # a torch built without CUDA
            raise RuntimeError(f"no CUDA to pin host memory with: {exc}") from exc
        if int(err) != 0:
            raise RuntimeError(f"cudaHostRegister of {t.numel() * t.element_size()} bytes: {err}")

    def unregister(self, t: torch.Tensor) -> None:
        err = torch.cuda.cudart().cudaHostUnregister(t.data_ptr())
        if int(err) != 0:
            raise RuntimeError(f"cudaHostUnregister: {err}")

    def is_pinned(self, t: torch.Tensor) -> bool:
        return bool(t.is_pinned())


OPS: DeviceOps = CudaOps()
"""The calls every new save and restore uses (tests replace it with a CPU stand-in)."""


def current() -> DeviceOps:
    return OPS
