"""Capture: turn a user's state dict into tensor items plus a JSON tree (training thread).

``state`` maps names to objects with ``state_dict()``/``load_state_dict()`` (modules,
optimizers, schedulers, GradScaler, samplers, :class:`~flashckpt.RNG`, any Stateful), tensors,
NumPy arrays, or JSON-able values. Capture calls ``state_dict()`` once per object and records
references, not copies; the engine decides what to copy right away and what to stage later.
Keys are saved without torch.compile's ``_orig_mod.`` segment (state/compiled.py).

An entry that is a ``transformers`` model (a ``PreTrainedModel``, also inside DDP or
torch.compile) also records its config and generation config as JSON in ``Captured.meta``
(``{"model": {"hf_config": {...}, "hf_generation_config": {...}}}``; the manifest's ``meta``),
so ``flashckpt export --format hf`` writes a directory ``from_pretrained`` loads with no flags.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from flashckpt.errors import ConfigError, UnsupportedStateError
from flashckpt.state.compiled import canonical
from flashckpt.state.dtensor import local_shard
from flashckpt.state.tree import Encoder
from flashckpt.store.format.dtypes import little_endian_array, numpy_dtype_name, torch_dtype_name

log = logging.getLogger(__name__)


@dataclass(kw_only=True)
class TensorItem:
    """One tensor (or this rank's shard of it) to save.

    ``data`` is a flat ``uint8`` view of the local bytes (CPU or CUDA); ``source`` is the tensor
    it views, kept so the engine can tell parameters and optimizer state (stable until the next
    ``optimizer.step()``) from buffers that change during forward.
    """

    key: str
    kind: str
    dtype: str
    shape: tuple[int, ...]
    global_shape: tuple[int, ...]
    global_offset: tuple[int, ...]
    data: torch.Tensor
    source: torch.Tensor | None = None
    replicated: bool = False

    @property
    def nbytes(self) -> int:
        return self.data.numel()


@dataclass(kw_only=True)
class Captured:
    tree: dict[str, Any] = field(default_factory=dict)
    items: list[TensorItem] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)  # JSON per entry (see module docstring)

    @property
    def nbytes(self) -> int:
        return sum(i.nbytes for i in self.items)


def is_stateful(obj: Any) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(
        getattr(obj, "load_state_dict", None)
    )


def check_state(state: Any) -> Mapping[str, Any]:
    if not isinstance(state, Mapping):
        raise ConfigError(
            f"state must be a dict of name -> object, got {type(state).__name__}; "
            'e.g. {"model": model, "optim": optimizer}'
        )
    for k in state:
        if not isinstance(k, str) or not k or "/" in k:
            raise ConfigError(f"state key {k!r} must be a non-empty string without '/'")
    return state


def capture(state: Mapping[str, Any]) -> Captured:
    """Flatten ``state``; raises :class:`UnsupportedStateError` before anything is written."""
    out = Captured()
    with torch.no_grad():  # the byte views need no autograd record (nor a detach each)
        for name, value in check_state(state).items():
            if isinstance(value, torch.Tensor):  # a bare tensor entry: no tree walk, no hooks
                out.tree[name] = {"__t__": name}  # what encode_tree gives a bare tensor
                out.items.append(_item(name, value))
                continue
            raw = value.state_dict() if is_stateful(value) else value
            enc = _Capture(out.items)  # each leaf becomes its TensorItem as it is found
            out.tree[name] = enc.encode(canonical(raw, name), name)  # no '_orig_mod.'
            if isinstance(value, torch.nn.Module):  # transformers models are modules
                meta = hf_meta(value)
                if meta:
                    out.meta[name] = meta
    return out


class _Capture(Encoder):
    """The tree encoder of state/tree.py, appending each tensor leaf's :class:`TensorItem` to
    ``items`` right away (no :class:`~flashckpt.state.tree.Leaf` list walked a second time)."""

    def __init__(self, items: list[TensorItem]) -> None:
        super().__init__()
        self.items = items

    def add_leaf(self, key: str, value: torch.Tensor | np.ndarray) -> None:
        self.items.append(_item(key, value))


def _hf_model(value: Any) -> Any:
    """``value`` (or the module DDP / torch.compile wrap) when it is a transformers model."""
    for obj in (value, getattr(value, "module", None), getattr(value, "_orig_mod", None)):
        if obj is not None and any(
            c.__name__ == "PreTrainedModel" and c.__module__.startswith("transformers")
            for c in type(obj).__mro__
        ):
            return obj
    return None


def hf_meta(value: Any) -> dict[str, Any]:
    """The config (and generation config) of a transformers model as JSON; {} for others."""
    model = _hf_model(value)
    if model is None:
        return {}
    out: dict[str, Any] = {}
    for key, attr in (("hf_config", "config"), ("hf_generation_config", "generation_config")):
        config: Any = getattr(model, attr, None)
        if not callable(getattr(config, "to_json_string", None)):
            continue
        try:  # the config's own JSON (dtypes as names), checked to be plain, finite JSON
            doc = json.loads(config.to_json_string(use_diff=False))
            json.dumps(doc, allow_nan=False)
        except (TypeError, ValueError) as exc:
            name = type(model).__name__
            log.warning("save: the %s of %s is not plain JSON (%s); not saved", attr, name, exc)
            continue
        if isinstance(doc, dict):
            out[key] = doc
    return out


_EMPTY = torch.empty(0, dtype=torch.uint8)  # the bytes of every empty tensor (never written)


_PLAIN = (torch.Tensor, torch.nn.Parameter)  # (torch.nn.Buffer makes a plain Tensor)
_DENSE = torch.strided


def _item(key: str, v: torch.Tensor | np.ndarray) -> TensorItem:
    if type(v) in _PLAIN:  # most leaves: no DTensor, subclass or NumPy checks
        t: Any = v
        if t.layout is _DENSE and not t.is_quantized and not t.is_meta:
            return _tensor_item(key, t, tuple(t.shape), (0,) * t.dim(), False, t)
        _refuse_layout(key, t)
    if isinstance(v, np.ndarray):
        arr = little_endian_array(v)
        return TensorItem(
            key=key,
            kind="numpy",
            dtype=numpy_dtype_name(arr.dtype, key),
            shape=tuple(arr.shape),
            global_shape=tuple(arr.shape),
            global_offset=(0,) * arr.ndim,
            data=torch.from_numpy(arr.reshape(-1).view(np.uint8)),
        )
    local, gshape, goffset, replicated = local_shard(v, key)
    if local.layout != torch.strided or local.is_quantized or local.is_meta:
        _refuse_layout(key, local)
    return _tensor_item(key, local, gshape, goffset, replicated, v)


def _refuse_layout(key: str, t: torch.Tensor) -> None:
    raise UnsupportedStateError(
        f"tensor {key!r} is {t.layout}/{t.device.type}; flashckpt saves dense "
        "tensors with data (convert sparse/quantized tensors, materialise meta tensors)"
    )


def _tensor_item(
    key: str,
    local: torch.Tensor,
    gshape: tuple[int, ...],
    goffset: tuple[int, ...],
    replicated: bool,
    source: torch.Tensor,
) -> TensorItem:
    """The item of a dense tensor ``local`` (this rank's shard of ``source``)."""
    dtype = torch_dtype_name(local.dtype, key)
    shape = tuple(local.shape)
    flat = local if local.is_contiguous() else local.contiguous()
    n = flat.numel()
    if not n:
        data = _EMPTY
    else:  # one view op where it suffices (each costs 0.5 us: most of a small tensor's capture)
        data = flat if flat.dim() == 1 else flat.reshape(-1)
        data = data if data.dtype == torch.uint8 else data.view(torch.uint8)
    if n * local.element_size() != data.numel():
        raise UnsupportedStateError(f"tensor {key!r} has an unexpected memory layout")
    return TensorItem(
        key=key,
        kind="torch",
        dtype=dtype,
        shape=shape,
        global_shape=shape if gshape == shape else gshape,
        global_offset=goffset,
        data=data,
        source=source,
        replicated=replicated,
    )
