"""One real training step of a real model, on fake tensors, with its live bytes metered.

:func:`trace_step` runs the step the user runs — forward under autocast (or in pure 16-bit),
the loss, backward, ``grad_accum`` micro-batches, the actual ``torch.optim`` optimizer with
its implementation (for-loop, foreach or fused), ``zero_grad(set_to_none=True)``, and the
recompute plan applied — on ``FakeTensorMode`` tensors: shapes, dtypes and every allocation
are real, no memory is allocated and no kernel runs. :class:`LiveBytes` meters it.

The user's module is not changed: its parameters and buffers are swapped for fake ones for
the call (and swapped back, also on error), training mode and a recompute plan are restored.
With ``fake=False`` the same step runs on the module's own tensors — that is how the tests
check the trace against a real run (it updates the module's weights).

The optimizer state is created by a first optimizer step before metering, so the metered step
is a steady-state step (states live during forward and backward, as from step 2 on).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from flashckpt.errors import ConfigError
from flashckpt.memory.recompute.planner import is_wrapped, unwrap_block, wrap_block
from flashckpt.memory.trace.kernels import KernelRules
from flashckpt.memory.trace.livebytes import CATEGORIES, LiveBytes

log = logging.getLogger(__name__)

OPTIMIZER_IMPLS = ("foreach", "fused", "for-loop")
PHASES = ("forward", "backward", "optimizer", "zero_grad")
Inputs = Callable[[int, int, torch.device], dict[str, Any]]
LossFn = Callable[[Any], torch.Tensor]


@dataclass(frozen=True, kw_only=True)
class TracedStep:
    """Peak live bytes of each phase and what was live at that moment, by category."""

    peaks: dict[str, int]
    at_peak: dict[str, dict[str, int]]
    num_params: int
    trainable_params: int
    device: str
    fake: bool
    notes: tuple[str, ...] = field(default_factory=tuple)
    # what CUDA's allocator reserves beyond the live bytes at their peak (block and segment
    # rounding, memory/allocator/blocks.py), by expandable_segments
    rounding: dict[bool, int] = field(default_factory=lambda: {True: 0, False: 0})

    @property
    def peak_bytes(self) -> int:
        return max(self.peaks.values())

    @property
    def peak_phase(self) -> str:
        return max(self.peaks, key=lambda p: self.peaks[p])


def _autocast(precision: str, device: torch.device) -> contextlib.AbstractContextManager[Any]:
    if precision == "bf16-mixed":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    if precision == "fp16-mixed":
        return torch.autocast(device.type, dtype=torch.float16)
    return contextlib.nullcontext()


def param_dtype(precision: str) -> torch.dtype:
    """Parameters' dtype: fp32 under autocast and fp32, 16-bit for pure bf16."""
    return torch.bfloat16 if precision == "bf16" else torch.float32


def build_optimizer(
    params: list[torch.Tensor], *, optimizer: Any, impl: str
) -> torch.optim.Optimizer:
    """The torch.optim optimizer named ``optimizer`` (or built by it, if callable)."""
    if callable(optimizer):
        return optimizer(params)
    if impl not in OPTIMIZER_IMPLS:
        raise ConfigError(f"optimizer_impl={impl!r}; accepted: {', '.join(OPTIMIZER_IMPLS)}")
    flags: dict[str, Any] = {"foreach": impl == "foreach"}
    if impl == "fused":
        flags = {"fused": True}
    if optimizer in ("adamw", "adam"):
        cls = torch.optim.AdamW if optimizer == "adamw" else torch.optim.Adam
        return cls(params, lr=1e-4, **flags)
    if optimizer in ("sgd", "sgd-momentum", "adamw-8bit"):
        # 8-bit Adam's state is added by the estimate (bitsandbytes is not traced): the step
        # is traced as plain SGD, which keeps no state and updates in place.
        momentum = 0.9 if optimizer == "sgd-momentum" else 0.0
        sgd_flags = {} if impl == "fused" and optimizer != "sgd-momentum" else flags
        return torch.optim.SGD(params, lr=1e-2, momentum=momentum, **sgd_flags)
    if optimizer == "adafactor":
        return torch.optim.Adafactor(params, lr=1e-2, foreach=impl == "foreach")
    raise ConfigError(f"optimizer={optimizer!r} cannot be traced")


@contextlib.contextmanager
def _swapped(model: nn.Module, dtype: torch.dtype | None, device: torch.device) -> Iterator[None]:
    """Give every module fake parameters/buffers (ties kept) for the block; restore after."""
    fakes: dict[int, torch.Tensor] = {}
    saved: list[tuple[dict[str, Any], str, Any]] = []

    def fake_of(t: torch.Tensor, *, param: bool) -> torch.Tensor:
        if id(t) not in fakes:
            want = dtype if (dtype is not None and t.is_floating_point()) else t.dtype
            new = torch.empty_strided(tuple(t.shape), t.stride(), dtype=want, device=device)
            if param and t.requires_grad:
                new.requires_grad_(True)
            fakes[id(t)] = new
        return fakes[id(t)]

    try:
        for module in model.modules():
            for table, param in ((module._parameters, True), (module._buffers, False)):
                for name, value in list(table.items()):
                    if value is not None:
                        saved.append((table, name, value))
                        table[name] = fake_of(value, param=param)  # type: ignore[assignment]
        yield
    finally:
        for table, name, value in reversed(saved):
            table[name] = value


@contextlib.contextmanager
def _training_mode(model: nn.Module, plan: Any) -> Iterator[None]:
    """model.train() and the recompute plan for the block; both undone after."""
    modes = [(m, m.training) for m in model.modules()]
    wrapped: list[nn.Module] = []
    try:
        model.train()
        if plan is not None:
            modules = dict(model.named_modules())
            missing = [n for n in plan.recompute if n not in modules]
            if missing:
                raise ConfigError(f"recompute plan names blocks the model lacks: {missing}")
            for name in plan.recompute:
                if not is_wrapped(modules[name]):
                    wrap_block(modules[name])
                    wrapped.append(modules[name])
        yield
    finally:
        for module in wrapped:
            unwrap_block(module)
        for module, mode in modes:
            module.training = mode


@contextlib.contextmanager
def fake_step_context(
    model: nn.Module, *, precision: str, device: torch.device, cuda_rules: bool = False
) -> Iterator[None]:
    """Fake tensors, the model's parameters swapped for fake ones, train mode, autocast."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with contextlib.ExitStack() as stack:
        if cuda_rules:
            from flashckpt.memory.trace.cudarules import CudaRules

            stack.enter_context(CudaRules())
        stack.enter_context(FakeTensorMode())
        stack.enter_context(KernelRules())
        stack.enter_context(_swapped(model, param_dtype(precision), device))
        stack.enter_context(_training_mode(model, None))
        stack.enter_context(torch.enable_grad())
        stack.enter_context(_autocast(precision, device))
        yield


def _trainable(model: nn.Module) -> list[torch.Tensor]:
    return [p for p in model.parameters() if p.requires_grad]


def _state_tensors(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [v for state in opt.state.values() for v in state.values() if torch.is_tensor(v)]


def _warm_up(
    opt: torch.optim.Optimizer, params: list[torch.Tensor], scalars: Callable[[], Any]
) -> None:
    for p in params:
        p.grad = torch.zeros_like(p)
    with scalars():
        opt.step()
    opt.zero_grad(set_to_none=True)


def _run(
    model: nn.Module,
    meter: LiveBytes,
    *,
    make_inputs: Callable[[], dict[str, Any]],
    loss_fn: LossFn,
    opt: torch.optim.Optimizer,
    precision: str,
    device: torch.device,
    grad_accum: int,
    scalars: Callable[[], Any],
) -> None:
    params = _trainable(model)
    meter.claim((*model.parameters(), *model.buffers()), "params")
    meter.claim(_state_tensors(opt), "optimizer")
    with contextlib.ExitStack() as hooks:
        for p in params:  # file each gradient as it lands, so backward's peak is split right
            handle = p.register_post_accumulate_grad_hook(lambda q: meter.claim((q.grad,), "grads"))
            hooks.callback(handle.remove)
        _micro_batches(
            model,
            meter,
            make_inputs=make_inputs,
            loss_fn=loss_fn,
            precision=precision,
            device=device,
            grad_accum=grad_accum,
        )
    meter.set_phase("optimizer")
    with scalars():  # an optimizer's scalar reads (Adafactor's norms) are run, see kernels.py
        opt.step()
    meter.claim(_state_tensors(opt), "optimizer")
    meter.set_phase("zero_grad")
    opt.zero_grad(set_to_none=True)


def _micro_batches(
    model: nn.Module,
    meter: LiveBytes,
    *,
    make_inputs: Callable[[], dict[str, Any]],
    loss_fn: LossFn,
    precision: str,
    device: torch.device,
    grad_accum: int,
) -> None:
    for _ in range(grad_accum):
        meter.set_phase("forward")
        inputs = make_inputs()
        with _autocast(precision, device):
            out = model(**inputs)
            loss = loss_fn(out) / grad_accum
        del out, inputs  # a training loop keeps the loss, not the model's outputs
        meter.set_phase("backward")
        loss.backward()
        del loss


def trace_step(
    model: nn.Module,
    *,
    make_inputs: Inputs,
    loss_fn: LossFn,
    batch_size: int,
    seq_len: int,
    precision: str = "bf16-mixed",
    optimizer: Any = "adamw",
    optimizer_impl: str = "foreach",
    grad_accum: int = 1,
    recompute: Any = None,
    device: str | torch.device = "cpu",
    logits_shape: tuple[int, int] | None = None,
    fake: bool = True,
    cuda_rules: bool = False,
) -> TracedStep:
    """Meter one training step of ``model`` (see the module docstring)."""
    if grad_accum < 1:
        raise ConfigError(f"grad_accum must be >= 1, got {grad_accum}")
    dev = torch.device(device)
    meter = LiveBytes(logits_shape=logits_shape)
    num_params = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in _trainable(model))
    scalars: Callable[[], Any] = contextlib.nullcontext
    with contextlib.ExitStack() as stack:
        if fake:
            from torch._subclasses.fake_tensor import FakeTensorMode

            stack.enter_context(FakeTensorMode())
            scalars = stack.enter_context(KernelRules()).concrete_scalars
            stack.enter_context(_swapped(model, param_dtype(precision), dev))
        stack.enter_context(_training_mode(model, recompute))
        stack.enter_context(torch.enable_grad())
        if cuda_rules:
            from flashckpt.memory.trace.cudarules import CudaRules

            stack.enter_context(CudaRules())
        params = _trainable(model)
        if not params:
            raise ConfigError(f"{type(model).__name__} has no trainable parameters to train")
        opt = build_optimizer(params, optimizer=optimizer, impl=optimizer_impl)
        _warm_up(opt, params, scalars)
        with meter:
            _run(
                model,
                meter,
                make_inputs=lambda: make_inputs(batch_size, seq_len, dev),
                loss_fn=loss_fn,
                opt=opt,
                precision=precision,
                device=dev,
                grad_accum=grad_accum,
                scalars=scalars,
            )
        del opt, params
    at_peak = {p: {c: meter.at_peak[p].get(c, 0) for c in CATEGORIES} for p in meter.at_peak}
    return TracedStep(
        peaks={p: meter.peaks[p] for p in PHASES if p in meter.peaks},
        at_peak={p: at_peak[p] for p in PHASES if p in at_peak},
        num_params=num_params,
        trainable_params=trainable,
        device="cuda (emulated on CPU)" if cuda_rules else dev.type,
        fake=fake,
        rounding={
            m: max(0, meter.reserved_peaks[m] - max(meter.peaks.values(), default=0))
            for m in (True, False)
        },
    )
