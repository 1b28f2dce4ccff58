"""The traced estimate: one real training step of an ``nn.Module`` on fake tensors.

:func:`trace_model` runs :func:`flashckpt.memory.trace.traced.trace_step` with the estimate's
options (precision, optimizer and its implementation, micro-batches, recompute plan) and the
model's own inputs and loss (a Hugging Face causal LM: ``input_ids``/``labels`` and
``output.loss``; any other module: ``inputs=`` and ``loss_fn=``). :func:`traced_estimate`
turns the metered phases into a :class:`MemoryEstimate`; data-parallel sharding (ZeRO 1-3 /
FSDP), 8-bit Adam and optimizer CPU offload are applied to the metered states afterwards, so
one trace answers every world size (docs/guides/memory.md, "Limits": what is and is not traced).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from flashckpt.errors import ConfigError
from flashckpt.memory.allocator.blocks import pool_slack
from flashckpt.memory.options import (
    ADAM_8BIT_BYTES_PER_PARAM,
    ALLOCATOR_WORKSPACE_BYTES,
    BREAKDOWN_KEYS,
    CUDA_CONTEXT_BYTES,
    EstimateOptions,
    MemoryEstimate,
)
from flashckpt.memory.recompute.profile import find_blocks, profile
from flashckpt.memory.trace.traced import TracedStep, fake_step_context, trace_step

log = logging.getLogger(__name__)


class _Blocks:
    """A recompute request as block names (what RecomputePlan.apply needs: ``recompute``)."""

    def __init__(self, names: list[str]) -> None:
        self.recompute = tuple(names)


def _plan_for(model: nn.Module, recompute: Any) -> Any:
    if recompute is None or recompute == "none":
        return None
    if hasattr(recompute, "recompute"):
        return recompute
    if recompute == "selective":
        raise ConfigError(
            "recompute='selective' is a formula option (Megatron's attention-core recompute); "
            "the traced path recomputes whole blocks: pass 'full', a number or a RecomputePlan"
        )
    blocks = find_blocks(model)
    if recompute == "full":
        return _Blocks(blocks)
    if isinstance(recompute, int) and not isinstance(recompute, bool):
        if not 0 <= recompute <= len(blocks):
            raise ConfigError(f"recompute={recompute} but the model has {len(blocks)} blocks")
        return _Blocks(blocks[:recompute])
    return _Blocks(list(recompute))


def _hf_inputs(vocab: int) -> Callable[[int, int, torch.device], dict[str, Any]]:
    def make(batch_size: int, seq_len: int, device: torch.device) -> dict[str, Any]:
        ids = torch.randint(0, vocab, (batch_size, seq_len), device=device)
        return {"input_ids": ids, "labels": ids}

    return make


def _hf_loss(out: Any) -> torch.Tensor:
    return out["loss"] if isinstance(out, dict) or hasattr(out, "keys") else out[0]


def _refuse(opts: EstimateOptions) -> None:
    if opts.tensor_parallel > 1 or opts.sequence_parallel:
        raise ConfigError(
            "the traced estimate measures one GPU's step without tensor parallelism; for "
            "tensor_parallel > 1 pass a shape or catalog name (method='formula')"
        )
    if opts.trainable_fraction != 1.0:
        raise ConfigError(
            "the traced estimate trains the model's own trainable parameters: freeze them "
            "(requires_grad=False) or wrap the model with peft instead of trainable_fraction"
        )
    if opts.dropout is not None:
        raise ConfigError(
            "the traced estimate uses the model's own dropout; build the model with the "
            "dropout you train with (e.g. config.resid_pdrop) instead of passing dropout="
        )


def default_device() -> str:
    """``"cuda"``: the planner plans GPUs (emulated on CPU where torch has no GPU)."""
    return "cuda"


def resolve_device(device: str | None) -> tuple[str, bool]:
    """(fake device, whether CUDA's rules are emulated on CPU tensors) for ``device``.

    ``"cuda"`` is fake CUDA tensors where torch has a GPU, else CPU tensors under
    :class:`flashckpt.memory.trace.cudarules.CudaRules`; ``"cpu"`` is a CPU step, exactly.
    """
    device = device or default_device()
    if device.startswith("cuda") and not torch.cuda.is_available():
        return "cpu", True
    return device, False


def trace_model(
    model: nn.Module,
    opts: EstimateOptions,
    *,
    inputs: Callable[[int, int, torch.device], dict[str, Any]] | None = None,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    device: str | None = None,
    fake: bool = True,
) -> TracedStep:
    """Meter one step of ``model`` with ``opts`` (``fake=False``: on its real tensors)."""
    _refuse(opts)
    config = getattr(model, "config", None)
    vocab = getattr(config, "vocab_size", None)
    if inputs is None:
        if not isinstance(vocab, int):
            raise ConfigError(
                f"{type(model).__name__} is not a Hugging Face language model: pass "
                "inputs=lambda batch_size, seq_len, device: {...forward kwargs...} and "
                "loss_fn=lambda output: loss"
            )
        inputs = _hf_inputs(vocab)
    tokens = opts.batch_size * opts.seq_len
    optimizer = "sgd" if opts.optimizer == "adamw-8bit" else opts.optimizer
    from torch._subclasses.fake_tensor import (
        DataDependentOutputException,
        DynamicOutputShapeException,
    )

    try:
        return _trace(model, opts, inputs, loss_fn, device, fake, optimizer, tokens, vocab)
    except (DynamicOutputShapeException, DataDependentOutputException) as exc:
        raise ConfigError(_data_dependent(model, exc)) from exc


def _call_site(exc: BaseException) -> str:
    """The innermost frame of ``exc``'s traceback outside torch and flashckpt: who asked."""
    import traceback
    from pathlib import Path

    skip = (str(Path(torch.__file__).parent), str(Path(__file__).parents[2]))
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if not f.filename.startswith(skip)]
    if not frames:
        return "inside torch"
    f = frames[-1]
    return f"{f.filename}:{f.lineno} in {f.name}: `{(f.line or '').strip()}`"


def _data_dependent(model: nn.Module, exc: BaseException) -> str:
    op = str(exc.args[0]) if exc.args else type(exc).__name__
    what = (
        "reads a tensor's value (.item(), .tolist(), bool() or a Python number)"
        if "_local_scalar_dense" in op
        else f"makes a tensor whose shape depends on values ({op})"
    )
    return (
        f"{type(model).__name__} {what} at {_call_site(exc)}; fake tensors have shapes but no "
        "values, so the trace stops there (an optimizer's scalar reads are run, a model's are "
        "not: a value may decide a shape). For a Hugging Face MoE use its default "
        "experts_implementation ('grouped_mm') or 'batched_mm', not 'eager'; else "
        "method='formula' with a dense shape"
    )


def _trace(
    model: nn.Module,
    opts: EstimateOptions,
    inputs: Any,
    loss_fn: Any,
    device: str | None,
    fake: bool,
    optimizer: Any,
    tokens: int,
    vocab: Any,
) -> TracedStep:
    return trace_step(
        model,
        make_inputs=inputs,
        loss_fn=loss_fn or _hf_loss,
        batch_size=opts.batch_size,
        seq_len=opts.seq_len,
        precision=opts.precision,
        optimizer=optimizer,
        optimizer_impl=opts.optimizer_impl,
        grad_accum=opts.grad_accum,
        recompute=_plan_for(model, opts.recompute),
        device=resolve_device(device)[0],
        logits_shape=(tokens * vocab, vocab) if isinstance(vocab, int) else None,
        fake=fake,
        cuda_rules=resolve_device(device)[1],
    )


def _zero_mixed(opts: EstimateOptions) -> bool:
    """ZeRO 1-3 in mixed precision: a 16-bit model, fp32 master weights in the optimizer."""
    return opts.zero_stage >= 1 and opts.precision.endswith("-mixed")


def _model_states(comp: dict[str, int], opts: EstimateOptions) -> dict[str, int]:
    """Parameters, gradients and optimizer state of one phase as this rank keeps them.

    The trace runs autocast (fp32 parameters and gradients, the fp32 parameters doubling as
    master weights). ZeRO in mixed precision (Rajbhandari et al. 2020, section 3.1) keeps a
    16-bit model (2 bytes of parameters, 2 of gradients per parameter) and moves the fp32
    master weights into the optimizer state (4 + Adam's 8 = 12 bytes): stage 1 shards the
    optimizer state over the ``N`` ranks (``4Psi + 12Psi/N``), stage 2 the gradients too
    (``2Psi + 14Psi/N``), stage 3 the parameters too (``16Psi/N``).
    """
    dp = opts.world_size
    params, grads, optimizer = comp["params"], comp["grads"], comp["optimizer"]
    if _zero_mixed(opts):
        params, grads, optimizer = params // 2, grads // 2, optimizer + params
    shard = {
        "params": dp if opts.zero_stage >= 3 else 1,
        "grads": dp if opts.zero_stage >= 2 else 1,
        "optimizer": dp if opts.zero_stage >= 1 else 1,
    }
    full = {"params": params, "grads": grads, "optimizer": optimizer}
    return {key: math.ceil(full[key] / shard[key]) for key in shard}


def _scaled(traced: TracedStep, opts: EstimateOptions) -> dict[str, dict[str, int]]:
    """Each phase's live bytes by category, after sharding, 8-bit state and offload."""
    opt_shard = opts.world_size if opts.zero_stage >= 1 else 1
    extra = 0
    if opts.optimizer == "adamw-8bit" and not opts.optimizer_offload:
        extra = math.ceil(ADAM_8BIT_BYTES_PER_PARAM * traced.trainable_params)
    out: dict[str, dict[str, int]] = {}
    for phase, comp in traced.at_peak.items():
        row = _model_states(comp, opts)
        row["optimizer"] = 0 if opts.optimizer_offload else row["optimizer"] + extra // opt_shard
        # autocast's 16-bit weight copies: a ZeRO 16-bit model computes with its own weights
        copies = 0 if _zero_mixed(opts) else comp.get("weight_copies", 0)
        temp = comp["activations"] + comp["logits"] + copies
        if phase == "optimizer":  # the step's temporaries, over the local shard
            row["optimizer_temp"] = 0 if opts.optimizer_offload else temp // opt_shard
            row["activations"] = row["logits"] = 0
        else:
            row["optimizer_temp"] = 0
            row["activations"], row["logits"] = comp["activations"] + copies, comp["logits"]
        out[phase] = row
    return out


def traced_estimate(
    traced: TracedStep, opts: EstimateOptions, *, layer_params: int = 0
) -> MemoryEstimate:
    """A :class:`MemoryEstimate` from a metered step and the options' sharding/offload."""
    phases = _scaled(traced, opts)
    peaks = {phase: sum(row.values()) for phase, row in phases.items()}
    fb = max(("forward", "backward"), key=lambda p: peaks.get(p, -1))
    on_cpu = traced.device == "cpu"  # a CPU run: no CUDA context, no cuBLAS workspaces
    workspace = 0 if on_cpu else ALLOCATOR_WORKSPACE_BYTES
    if opts.zero_stage == 3 and opts.world_size > 1:
        workspace += 2 * 2 * layer_params  # gather one block's 16-bit params, prefetch the next
    allocated = workspace + max(peaks.values())
    breakdown = {key: max(row[key] for row in phases.values()) for key in ("params", "grads")}
    breakdown["optimizer"] = max(row["optimizer"] for row in phases.values())
    breakdown["optimizer_temp"] = phases.get("optimizer", {}).get("optimizer_temp", 0)
    breakdown["master_weights"] = 0  # autocast: the fp32 parameters are the master weights
    breakdown["activations"] = phases[fb]["activations"]
    breakdown["logits"] = phases[fb]["logits"]
    breakdown["workspace"] = workspace + (0 if on_cpu else CUDA_CONTEXT_BYTES)
    if opts.fragmentation_fraction is not None:
        breakdown["fragmentation_margin"] = math.ceil(opts.fragmentation_fraction * allocated)
    elif on_cpu:
        breakdown["fragmentation_margin"] = 0  # a CPU run: no caching allocator to round
    else:  # what CUDA's caching allocator reserves beyond these bytes (allocator/blocks.py)
        expandable = opts.expandable_segments
        breakdown["fragmentation_margin"] = traced.rounding[expandable] + pool_slack(
            expandable=expandable
        )
    notes = [f"traced one step on fake {traced.device} tensors; peak in {traced.peak_phase}"]
    if traced.device == "cpu":
        notes.append("a CPU run: CPU kernels and autocast rules, no CUDA context (device='cpu')")
    elif "emulated" in traced.device:
        notes.append("no CUDA here: CUDA's attention kernel and autocast fp32 ops emulated")
    return MemoryEstimate(
        shape=None,
        num_params=traced.num_params,
        options=opts,
        breakdown={key: breakdown[key] for key in BREAKDOWN_KEYS},
        allocated_peak_bytes=allocated,
        method="traced",
        phase_peaks=peaks,
        notes=tuple(notes),
        context_bytes=0 if on_cpu else CUDA_CONTEXT_BYTES,
    )


def profile_blocks(
    model: nn.Module,
    opts: EstimateOptions,
    *,
    device: str | None = None,
    blocks: list[str] | None = None,
    inputs: Callable[[int, int, torch.device], dict[str, Any]] | None = None,
) -> list[tuple[int, int]]:
    """(saved bytes, input bytes) of each block in one fake forward (saved-tensor hooks)."""
    name, cuda_rules = resolve_device(device)
    dev = torch.device(name)
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    if inputs is None:
        if not isinstance(vocab, int):
            raise ConfigError(f"{type(model).__name__}: pass inputs= to profile its blocks")
        inputs = _hf_inputs(vocab)
    with fake_step_context(model, precision=opts.precision, device=dev, cuda_rules=cuda_rules):
        prof = profile(model, blocks=blocks, **inputs(opts.batch_size, opts.seq_len, dev))
    return [(b.activation_bytes, b.input_bytes) for b in prof.blocks]
