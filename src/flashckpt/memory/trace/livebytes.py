"""Live bytes of every tensor storage, op by op: the meter behind the traced estimate.

A :class:`LiveBytes` ``TorchDispatchMode`` sees the output of every ATen op (forward, the
autograd engine's backward ops, optimizer kernels), registers each new storage once with a
weak reference, and subtracts its size when the storage dies. It works the same on real and
on fake tensors (``FakeTensorMode``), which is how the estimate's trace is checked against a
real run: the same meter, two kinds of tensor. This is the approach of torch's own
``torch.distributed._tools.mem_tracker``; the meter also keeps, for each phase, the peak and
what was live at that moment (parameters, gradients, optimizer state, logits, the rest).

It also keeps what CUDA's caching allocator would reserve for the same live tensors, block
rounding included (:mod:`flashckpt.memory.allocator.blocks`), with and without expandable
segments: ``reserved_peaks``, from which the estimate takes its fragmentation margin.

Memory a kernel allocates internally (cuBLAS workspaces, FlashAttention scratch) never appears
as an op output and is not seen; the estimate adds a constant for it.
"""

from __future__ import annotations

import functools
import logging
import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from flashckpt.memory.allocator.blocks import reserved_bytes

log = logging.getLogger(__name__)

CATEGORIES = ("params", "grads", "optimizer", "logits", "activations", "weight_copies")
_TO_COPY = torch.ops.aten._to_copy.default


def _storage(t: torch.Tensor) -> Any:
    try:
        return t.untyped_storage()
    except (RuntimeError, NotImplementedError):  # sparse, nested, storage-less subclasses
        return None


class LiveBytes(TorchDispatchMode):
    """Count the bytes of live storages; ``peaks[phase]`` and ``at_peak[phase]`` per phase.

    ``logits_shape=(numel, vocab)``: in forward and backward, an op output whose last dimension
    is ``vocab`` with at least ``numel`` elements is filed as ``logits`` (the LM head's output,
    the loss's copies of it and their gradients); everything else new is ``activations`` until
    :meth:`claim` files it elsewhere (parameters, gradients, optimizer state). A cast of a
    parameter in forward or backward (autocast's cached 16-bit weight copies) is filed as
    ``weight_copies``: a model kept in 16 bits (DeepSpeed's ZeRO) has none.
    """

    def __init__(self, *, logits_shape: tuple[int, int] | None = None) -> None:
        super().__init__()
        self.logits_shape = logits_shape
        self.live = 0
        self.totals = dict.fromkeys(CATEGORIES, 0)
        self.phase = "setup"
        self.peaks: dict[str, int] = {}
        self.at_peak: dict[str, dict[str, int]] = {}
        self.category_peaks = dict.fromkeys(CATEGORIES, 0)
        # id(storage) -> [weakref, nbytes, category, reserved (expandable), reserved (classic)]
        self._entries: dict[int, list[Any]] = {}
        self.reserved_live = {True: 0, False: 0}  # by expandable_segments
        self.reserved_peaks = {True: 0, False: 0}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func is _TO_COPY and self._is_param(args[0]) and isinstance(out, torch.Tensor):
            self.track(out, "weight_copies")  # autocast's 16-bit copy of a parameter
            return out
        for leaf in tree_leaves(out):
            if isinstance(leaf, torch.Tensor):
                self.track(leaf)
        return out

    def track(self, t: torch.Tensor, category: str | None = None) -> None:
        """Count ``t``'s storage if it is new (``category`` files it; default by size)."""
        storage = _storage(t)
        if storage is None:
            return
        key = id(storage)
        entry = self._entries.get(key)
        if entry is not None and entry[0]() is storage:
            if category is not None:
                self._move(entry, category)
            return
        nbytes = storage.nbytes()
        if category is None:
            category = "logits" if self._is_logits(t) else "activations"
        ref = weakref.ref(storage, functools.partial(self._on_death, key))
        held = (reserved_bytes(nbytes, expandable=True), reserved_bytes(nbytes, expandable=False))
        self._entries[key] = [ref, nbytes, category, *held]
        self.live += nbytes
        for expandable, n in zip((True, False), held):
            self.reserved_live[expandable] += n
            if self.reserved_live[expandable] > self.reserved_peaks[expandable]:
                self.reserved_peaks[expandable] = self.reserved_live[expandable]
        self._add(category, nbytes)
        self._note()

    def _is_param(self, t: Any) -> bool:
        if self.phase not in ("forward", "backward") or not isinstance(t, torch.Tensor):
            return False
        storage = _storage(t)
        entry = self._entries.get(id(storage)) if storage is not None else None
        return entry is not None and entry[0]() is storage and entry[2] == "params"

    def _is_logits(self, t: torch.Tensor) -> bool:
        if self.logits_shape is None or self.phase not in ("forward", "backward") or not t.dim():
            return False
        numel, vocab = self.logits_shape
        return t.shape[-1] == vocab and t.numel() >= numel

    def claim(self, tensors: Iterable[torch.Tensor | None], category: str) -> None:
        """File the storages of ``tensors`` (counting them first if new) under ``category``."""
        for t in tensors:
            if t is not None:
                self.track(t, category)

    def set_phase(self, phase: str) -> None:
        self.phase = phase
        self._note()

    def _move(self, entry: list[Any], category: str) -> None:
        if entry[2] != category:
            self.totals[entry[2]] -= entry[1]
            entry[2] = category
            self._add(category, entry[1])

    def _add(self, category: str, nbytes: int) -> None:
        self.totals[category] += nbytes
        if self.totals[category] > self.category_peaks[category]:
            self.category_peaks[category] = self.totals[category]

    def _on_death(self, key: int, _ref: Any) -> None:
        self._free(key)

    def _free(self, key: int) -> None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self.live -= entry[1]
            self.totals[entry[2]] -= entry[1]
            self.reserved_live[True] -= entry[3]
            self.reserved_live[False] -= entry[4]

    def _note(self) -> None:
        if self.live > self.peaks.get(self.phase, -1):
            self.peaks[self.phase] = self.live
            self.at_peak[self.phase] = dict(self.totals)
