"""The accelerator calls the save path makes, behind one small object.

Staging device tensors needs a handful of CUDA calls: is CUDA usable (to pin the staging
arena), an event recorded on the training stream at ``save()``, a side stream that waits for
that event, a context that makes it current, and the device of each tensor. They all go through
:class:`DeviceOps`, so the device-staging logic (fingerprints, streams, events, the copies into
the pool) is one code path, and a test can run it on CPU by swapping :data:`OPS` for a stand-in
that calls CPU tensors "device" tensors and records the calls.

Contract of a ``DeviceOps``:

1. ``device_of(tensor)`` names the device a tensor's bytes live on ("cpu" stages through the
   CPU path; anything else through the device path).
2. ``available()``: True when pinned host memory can be allocated.
3. ``event()`` returns an event recorded on the current (training) stream; ``stream(device)``
   a new side stream with ``wait_event(event)`` and ``synchronize()``; ``use(stream)`` a
   context manager that makes it current for the copies and fingerprints issued inside it.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any, Protocol

import torch


class DeviceOps(Protocol):
    def device_of(self, t: torch.Tensor) -> str: ...
    def available(self) -> bool: ...
    def event(self) -> Any: ...
    def stream(self, device: Any) -> Any: ...
    def use(self, stream: Any) -> AbstractContextManager[Any]: ...


class CudaOps:
    """The real calls (``torch.cuda``)."""

    def device_of(self, t: torch.Tensor) -> str:
        return str(t.device)

    def available(self) -> bool:
        return torch.cuda.is_available()

    def event(self) -> Any:
        ev = torch.cuda.Event()
        ev.record()
        return ev

    def stream(self, device: Any) -> Any:
        return torch.cuda.Stream(device=device)

    def use(self, stream: Any) -> AbstractContextManager[Any]:
        return torch.cuda.stream(stream)


OPS: DeviceOps = CudaOps()
"""The calls every new save uses (tests replace it with a CPU stand-in)."""


def current() -> DeviceOps:
    return OPS
