"""Measure what each block of a model saves for backward, and how long its forward takes.

Saved-tensor hooks (``torch.autograd.graph.saved_tensors_hooks``) see every tensor autograd
keeps for backward, on any device including ``meta``; module hooks say which block is running.
Tensors are counted once per storage, at their storage's size; parameters and buffers are not
activations and are skipped. Nothing is kept for backward while profiling, so a profile run
needs only the forward's transient memory.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from flashckpt.errors import ConfigError

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class BlockProfile:
    """One block: bytes it saves for backward, bytes of its input, forward seconds."""

    name: str
    activation_bytes: int
    input_bytes: int
    forward_s: float

    def __post_init__(self) -> None:
        if self.activation_bytes < 0 or self.input_bytes < 0 or self.forward_s < 0:
            raise ConfigError(f"BlockProfile {self.name!r}: sizes and times must be >= 0")


@dataclass(frozen=True, kw_only=True)
class ModelProfile:
    """Blocks in forward order, plus what the rest of the model saves (embeddings, head, loss)."""

    blocks: Sequence[BlockProfile]
    other_activation_bytes: int = 0
    forward_s: float = 0.0
    device: str = "cpu"
    block_names: tuple[str, ...] = field(init=False)

    def __post_init__(self) -> None:
        names = tuple(b.name for b in self.blocks)
        if len(set(names)) != len(names):
            raise ConfigError(f"ModelProfile: block names must be unique, got {list(names)}")
        object.__setattr__(self, "blocks", tuple(self.blocks))
        object.__setattr__(self, "block_names", names)

    @property
    def activation_bytes(self) -> int:
        """Everything saved for backward with no recompute."""
        return sum(b.activation_bytes for b in self.blocks) + self.other_activation_bytes


def find_blocks(model: nn.Module) -> list[str]:
    """Qualified names of the repeated layers: the children of every outermost uniform
    ``nn.ModuleList`` (two or more layers of one type) that holds at least a tenth of the
    parameters of the largest one, in module order. A decoder has one such stack; an
    encoder-decoder (T5, BART, Whisper) has two, and both are recomputable."""
    stacks: list[tuple[str, int]] = []
    for name, module in model.named_modules():
        if not isinstance(module, nn.ModuleList) or len(module) < 2:
            continue
        if len({type(child) for child in module}) != 1:
            continue
        if any(name.startswith(f"{outer}.") for outer, _ in stacks):
            continue  # a list inside a block (experts, sub-layers) is part of that block
        stacks.append((name, sum(p.numel() for p in module.parameters())))
    if not stacks:
        raise ConfigError(
            f"no repeated blocks found in {type(model).__name__} (no nn.ModuleList of two or "
            "more same-type layers); pass blocks=['layer1', 'layer2', ...]"
        )
    largest = max(size for _, size in stacks)
    modules = dict(model.named_modules())
    out: list[str] = []
    for name, size in stacks:
        if size * 10 >= largest or (largest == 0 and size == 0):
            prefix = f"{name}." if name else ""
            out += [f"{prefix}{i}" for i in range(len(modules[name]))]
    return out


def _storage_key(t: torch.Tensor) -> tuple[int, int]:
    try:
        storage = t.untyped_storage()
        return (storage._cdata, storage.nbytes())
    except (RuntimeError, NotImplementedError):  # tensor subclasses without a storage
        return (id(t), t.numel() * t.element_size())


def _tensor_bytes(values: Any) -> int:
    if isinstance(values, torch.Tensor):
        return values.untyped_storage().nbytes()
    if isinstance(values, (list, tuple)):
        return sum(_tensor_bytes(v) for v in values)
    if isinstance(values, dict):
        return sum(_tensor_bytes(v) for v in values.values())
    return 0


class _Recorder:
    """Attributes each newly saved storage to the block running when autograd saved it."""

    def __init__(self, model: nn.Module, names: Sequence[str]) -> None:
        self.skip = {_storage_key(t) for t in (*model.parameters(), *model.buffers())}
        self.seen: set[tuple[int, int]] = set()
        self.current: str | None = None
        self.saved = dict.fromkeys(names, 0)
        self.inputs = dict.fromkeys(names, 0)
        self.start_s = dict.fromkeys(names, 0.0)
        self.times = dict.fromkeys(names, 0.0)
        self.other = 0
        self.keep: list[torch.Tensor] = []
        self.sync: Callable[[], None] = lambda: None

    def pack(self, t: torch.Tensor) -> None:
        # Return nothing: the graph is never run backward, and returning ``t`` itself for a
        # saved output ties it to its own grad_fn in a reference cycle that leaks the graph.
        # Storages are held (in ``keep``) until the forward ends, so addresses are not reused.
        key = _storage_key(t)
        if key not in self.skip and key not in self.seen:
            self.seen.add(key)
            self.keep.append(t.detach())
            if self.current is None:
                self.other += key[1]
            else:
                self.saved[self.current] += key[1]

    @staticmethod
    def unpack(_packed: None) -> torch.Tensor:
        raise ConfigError("the graph built by memory.profile() cannot be run backward")

    def pre_hook(self, name: str) -> Callable[..., None]:
        def hook(_module: nn.Module, args: Any, kwargs: Any) -> None:
            self.inputs[name] += _tensor_bytes(args) + _tensor_bytes(kwargs)
            self.current = name
            self.sync()
            self.start_s[name] = time.perf_counter()

        return hook

    def post_hook(self, name: str) -> Callable[..., None]:
        def hook(_module: nn.Module, _args: Any, _kwargs: Any, _out: Any) -> None:
            self.sync()
            self.times[name] += time.perf_counter() - self.start_s[name]
            self.current = None

        return hook


def profile(
    model: nn.Module,
    *sample_inputs: Any,
    blocks: Sequence[str] | None = None,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    **sample_kwargs: Any,
) -> ModelProfile:
    """Run one forward of ``model(*sample_inputs)`` and measure each block.

    ``blocks``: qualified module names (default :func:`find_blocks`). ``loss_fn`` (optional)
    maps the output to a loss so the loss's saved tensors are counted too. Nothing is kept:
    the graph is dropped after measuring. Times on ``meta`` are zero (no kernels run).
    """
    names = list(blocks) if blocks is not None else find_blocks(model)
    modules = dict(model.named_modules())
    missing = [n for n in names if n not in modules]
    if missing:
        raise ConfigError(f"blocks not found in the model: {missing}; see model.named_modules()")
    rec = _Recorder(model, names)
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    if device.type == "cuda":
        rec.sync = torch.cuda.synchronize
    start_s = time.perf_counter()
    with ExitStack() as stack:
        for name in names:
            mod = modules[name]
            h1 = mod.register_forward_pre_hook(rec.pre_hook(name), with_kwargs=True)
            h2 = mod.register_forward_hook(rec.post_hook(name), with_kwargs=True)
            stack.callback(h1.remove)
            stack.callback(h2.remove)
        stack.enter_context(torch.autograd.graph.saved_tensors_hooks(rec.pack, rec.unpack))
        stack.enter_context(torch.enable_grad())
        out = model(*sample_inputs, **sample_kwargs)
        if loss_fn is not None:
            out = loss_fn(out)
        rec.sync()
    total_s = time.perf_counter() - start_s
    del out
    rec.keep.clear()
    on_meta = device.type == "meta"
    return ModelProfile(
        blocks=[
            BlockProfile(
                name=n,
                activation_bytes=rec.saved[n],
                input_bytes=rec.inputs[n],
                forward_s=0.0 if on_meta else rec.times[n],
            )
            for n in names
        ],
        other_activation_bytes=rec.other,
        forward_s=0.0 if on_meta else total_s,
        device=device.type,
    )
