"""Overlap with training: optimizer pre-step hooks that wait for staging.

Parameters and optimizer state change only inside ``optimizer.step()``. A save therefore only
has to finish copying them before the next step starts, not before ``save()`` returns: the
Checkpointer registers a pre-step hook on each optimizer found in the state, and the hook waits
for the current save's ``staged`` future. Everything else in the state (module buffers such as
BatchNorm statistics, GradScaler, RNG states) is copied at ``save()`` time.

A protected tensor that changes anyway before staging finished (parameters updated outside
``optimizer.step()``: SAM's perturbation, local-SGD averaging, an EMA written in place) would
make a checkpoint that mixes two states. :class:`MutationGuard` notes each protected tensor's
version counter at ``save()`` and fails the save, naming the tensor, when one moved.
"""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from flashckpt.errors import SaveError
from flashckpt.state.capture import Captured
from flashckpt.state.dtensor import local_tensor

log = logging.getLogger(__name__)


def find_optimizers(state: Mapping[str, Any]) -> list[torch.optim.Optimizer]:
    return [v for v in state.values() if isinstance(v, torch.optim.Optimizer)]


def _ptr(t: torch.Tensor) -> int:
    return int(local_tensor(t).data_ptr())


def protected_pointers(optimizers: Iterable[torch.optim.Optimizer]) -> set[int]:
    """Storage pointers that only ``optimizer.step()`` mutates: params and optimizer state."""
    ptrs: set[int] = set()
    for opt in optimizers:
        for group in opt.param_groups:
            for p in group["params"]:
                ptrs.add(_ptr(p))
        for st in opt.state.values():
            for v in st.values():
                if isinstance(v, torch.Tensor):
                    ptrs.add(_ptr(v))
    return ptrs


def copy_unprotected(captured: Captured, protected: set[int]) -> None:
    """Copy now what training may change before the next optimizer step (buffers etc.)."""
    for item in captured.items:
        if item.kind == "numpy" or item.data.data_ptr() not in protected:
            item.data = item.data.clone()


class MutationGuard:
    """The version counters of the tensors a save reads after ``save()`` returned."""

    def __init__(self, captured: Captured) -> None:
        # a protected item's data is a view of the live tensor and shares its version counter
        self._watched = [(item.key, item.data, item.data._version) for item in captured.items]

    def check(self, step: int) -> None:
        """Raise :class:`SaveError` when a watched tensor changed since ``save()``."""
        changed = [key for key, t, version in self._watched if t._version != version]
        if changed:
            names = ", ".join(repr(k) for k in changed[:5])
            more = f" and {len(changed) - 5} more" if len(changed) > 5 else ""
            raise SaveError(
                f"checkpoint step {step}: tensor {names}{more} changed after save() returned and "
                "before staging finished, outside optimizer.step() (e.g. SAM, local-SGD "
                "averaging, an in-place EMA); the checkpoint would mix two states, so nothing "
                "was committed. Pass overlap=False to copy parameters and optimizer state at "
                "save(), or call save() after that change"
            )


class StepGate:
    """Installs pre-step hooks once per optimizer; ``wait`` is called by the hooks.

    Keyed by the optimizer object itself (weakly), never by ``id()``: an id is reused once its
    optimizer is freed, and a new optimizer at the old address would get no hook."""

    def __init__(self, wait: Callable[[], None]) -> None:
        self._wait = wait
        self._handles: weakref.WeakKeyDictionary[torch.optim.Optimizer, Any] = (
            weakref.WeakKeyDictionary()
        )

    def install(self, optimizers: Iterable[torch.optim.Optimizer]) -> None:
        for opt in optimizers:
            if opt not in self._handles:
                self._handles[opt] = opt.register_step_pre_hook(self._hook)

    def _hook(self, opt: Any, args: Any, kwargs: Any) -> None:
        t0 = time.perf_counter()
        self._wait()
        dt = time.perf_counter() - t0
        if dt > 0.001:
            log.debug("optimizer step waited %.3fs for checkpoint staging", dt)

    def remove(self) -> None:
        for h in list(self._handles.values()):
            h.remove()
        self._handles.clear()
