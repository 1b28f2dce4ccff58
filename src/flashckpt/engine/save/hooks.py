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

Frozen parameters of the modules in the state count as protected too (a LoRA base is never
copied at ``save()``: it does not change, and the guard watches it like the rest), and a tensor
the capture copied already (a ``channels_last`` weight made contiguous) is not copied again.

What the guard cannot see, and how it is handled:

* writes through ``.data`` (``p.data.mul_(0.9)``): ``.data`` is a new alias with its *own*
  version counter. While a save is being staged, the guard hands out ``.data`` of a watched
  tensor through a property that remembers the alias, and checks its counter too. An alias
  taken before ``save()`` and written after it is still invisible: use ``torch.no_grad()``
  and write the parameter itself, or ``overlap=False``.
* CUDA-graph replays of a captured optimizer step bump no version counter and call no
  pre-step hook: a save of an optimizer with ``capturable=True`` (the flag graph capture
  needs) does not overlap (:func:`overlap_safe`), it copies at ``save()``.
"""

from __future__ import annotations

import logging
import threading
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


def module_pointers(state: Mapping[str, Any]) -> set[int]:
    """Storage pointers of the frozen parameters (``requires_grad=False``) of the modules in
    ``state``: no ``step()`` changes them, so they are protected like the optimizer's (a
    trainable parameter outside every optimizer of the state may be stepped by another one,
    and is still copied at ``save()``)."""
    return {
        _ptr(p)
        for v in state.values()
        if isinstance(v, torch.nn.Module)
        for p in v.parameters()
        if not p.requires_grad
    }


def overlap_safe(optimizers: Iterable[torch.optim.Optimizer]) -> bool:
    """False when an optimizer may be stepped by a CUDA-graph replay (``capturable=True``):
    a replay calls no pre-step hook, so staging could not overlap it safely."""
    for opt in optimizers:
        if any(group.get("capturable") for group in opt.param_groups):
            log.warning(
                "an optimizer has capturable=True (CUDA graphs): this save copies its state at "
                "save() instead of overlapping the next step"
            )
            return False
    return True


def copy_unprotected(captured: Captured, protected: set[int]) -> None:
    """Copy now what training may change before the next optimizer step (buffers etc.).
    Never a protected tensor, and never an item the capture copied already (it is a
    snapshot taken at ``save()``)."""
    for item in captured.items:
        stable = item.data.data_ptr() in protected or _copied(item.data, item.source)
        if item.kind == "numpy" or not stable:
            item.data = item.data.clone()


def _copied(data: torch.Tensor, source: torch.Tensor | None) -> bool:
    if source is None or not data.numel():
        return False
    src = local_tensor(source)
    return bool(data.untyped_storage().data_ptr() != src.untyped_storage().data_ptr())


class MutationGuard:
    """The version counters of the tensors a save reads after ``save()`` returned, and of the
    ``.data`` aliases of them taken while it stages (:class:`_DataAliases`)."""

    def __init__(self, captured: Captured) -> None:
        # a protected item's data is a view of the live tensor and shares its version counter
        self._watched = [(item.key, item.data, item.data._version) for item in captured.items]
        keys = {_storage(item.data): item.key for item in captured.items if item.data.numel()}
        self._aliases = _DataAliases(keys)
        _DATA.watch(self._aliases)

    def close(self) -> None:
        """Stop watching ``.data`` (the save staged, or failed). Idempotent."""
        _DATA.unwatch(self._aliases)

    def check(self, step: int) -> None:
        """Raise :class:`SaveError` when a watched tensor changed since ``save()``."""
        self.close()
        changed = [key for key, t, version in self._watched if t._version != version]
        changed += [k for k in self._aliases.changed() if k not in changed]
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


def _storage(t: torch.Tensor) -> int:
    return int(t.untyped_storage().data_ptr())


class _DataAliases:
    """The ``.data`` aliases of watched storages handed out during one save's staging."""

    def __init__(self, keys: dict[int, str]) -> None:
        self.keys = keys
        self.taken: list[tuple[str, torch.Tensor, int]] = []

    def saw(self, alias: torch.Tensor) -> None:
        try:
            if alias.device.type == "meta" or not alias.numel():
                return
            ptr = _storage(alias)
        except (RuntimeError, NotImplementedError):  # a wrapper subclass has no storage
            return
        key = self.keys.get(ptr)
        if key is not None:
            self.taken.append((key, alias, alias._version))

    def changed(self) -> list[str]:
        return [key for key, t, version in self.taken if t._version != version]


class _DataProperty:
    """Installs a ``Tensor.data`` property while at least one guard watches (the built-in
    descriptor does the work; the property only remembers aliases of watched storages)."""

    def __init__(self) -> None:
        self._guards: list[_DataAliases] = []
        self._lock = threading.Lock()
        self._base: Any = torch._C.TensorBase.__dict__["data"]  # the built-in descriptor

    def watch(self, aliases: _DataAliases) -> None:
        with self._lock:
            self._guards.append(aliases)
            if len(self._guards) == 1:
                base, guards = self._base, self._guards

                def get(t: torch.Tensor) -> torch.Tensor:
                    alias = base.__get__(t)
                    for g in list(guards):
                        g.saw(alias)
                    return alias

                def put(t: torch.Tensor, value: torch.Tensor) -> None:
                    base.__set__(t, value)

                torch.Tensor.data = property(get, put)  # type: ignore[assignment, method-assign]

    def unwatch(self, aliases: _DataAliases) -> None:
        with self._lock:
            if aliases in self._guards:
                self._guards.remove(aliases)
                if not self._guards and "data" in torch.Tensor.__dict__:
                    del torch.Tensor.data  # type: ignore[misc]


_DATA = _DataProperty()


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
