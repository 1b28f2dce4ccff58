"""A real CPU training step measured by torch's MemTracker: the reference for the estimate.

:func:`measured_peak` runs what a user's loop runs (autocast or pure 16-bit, the loss,
backward, ``grad_accum`` micro-batches, the optimizer, ``zero_grad(set_to_none=True)``; the
optimizer state created by a first step) and returns the peak bytes
``torch.distributed._tools.mem_tracker.MemTracker`` saw in the second step.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed._tools.mem_tracker import MemTracker

OPTIMIZERS: dict[str, Callable[[list[torch.Tensor]], torch.optim.Optimizer]] = {
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-4, foreach=True),
    "adamw-fused": lambda ps: torch.optim.AdamW(ps, lr=1e-4, fused=True),
    "adamw-for-loop": lambda ps: torch.optim.AdamW(ps, lr=1e-4, foreach=False),
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-4, foreach=True),
    "sgd": lambda ps: torch.optim.SGD(ps, lr=1e-2, foreach=True),
    "sgd-momentum": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, foreach=True),
    "adafactor": lambda ps: torch.optim.Adafactor(ps, lr=1e-2, foreach=True),
    "adafactor-for-loop": lambda ps: torch.optim.Adafactor(ps, lr=1e-2, foreach=False),
}


def hf_inputs(vocab: int) -> Callable[[int, int], dict[str, Any]]:
    def make(batch: int, seq: int) -> dict[str, Any]:
        ids = torch.randint(0, vocab, (batch, seq))
        return {"input_ids": ids, "labels": ids}

    return make


def _loss(out: Any) -> torch.Tensor:
    return out["loss"] if hasattr(out, "keys") else out[0]


def measured_peak(
    model: torch.nn.Module,
    *,
    batch: int,
    seq: int,
    precision: str = "bf16-mixed",
    optimizer: str = "adamw",
    grad_accum: int = 1,
    recompute: tuple[str, ...] = (),
    inputs: Callable[[int, int], dict[str, Any]] | None = None,
) -> int:
    """Peak bytes of one steady-state CPU step of ``model`` (MemTracker); trains ``model``."""
    from flashckpt.memory.recompute.planner import unwrap_block, wrap_block

    torch.manual_seed(0)
    if precision == "bf16":
        model.to(torch.bfloat16)
    model.train()
    make = inputs or hf_inputs(model.config.vocab_size)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = OPTIMIZERS[optimizer](params)
    modules = dict(model.named_modules())
    for name in recompute:
        wrap_block(modules[name])

    def autocast() -> Any:
        if precision.endswith("-mixed"):
            dtype = torch.bfloat16 if precision.startswith("bf16") else torch.float16
            return torch.autocast("cpu", dtype=dtype)
        return contextlib.nullcontext()

    tracker = MemTracker()

    def step(tracking: bool = False) -> None:
        for i in range(grad_accum):
            if tracking and i:  # MemTracker refuses a module's second forward in one step
                tracker.reset_mod_stats()  # per-module stats only; the peak is kept
            batch_inputs = make(batch, seq)
            with autocast():
                loss = _loss(model(**batch_inputs)) / grad_accum
            del batch_inputs
            loss.backward()
            del loss
        opt.step()
        opt.zero_grad(set_to_none=True)

    try:
        step()
        tracker.track_external(model, opt)
        with tracker:
            step(tracking=True)
        peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
    finally:
        for name in recompute:
            unwrap_block(modules[name])
    return int(peak)
