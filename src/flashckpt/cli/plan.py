"""``flashckpt plan``: will a model, batch and sequence length fit on a GPU; if not, what then.

With transformers installed, a catalog name or a Hugging Face ``config.json`` is built on the
meta device and *traced* (one real training step on fake tensors); otherwise, or with
``--method formula``, the closed forms answer. Every answer below the breakdown (recompute
plan, preallocation, largest batch, fewest GPUs) comes from the same sizer.
"""

from __future__ import annotations

import argparse
import logging
import os
from typing import Any

from flashckpt.cli import argtypes
from flashckpt.errors import ConfigError
from flashckpt.memory import (
    PRECISIONS,
    MemoryEstimate,
    MemoryPlanError,
    evaluate_plan,
    every_k_plan,
    gpu_by_name,
    known_gpus,
    known_shapes,
    plan_recompute,
    recommend_allocator_settings,
    resolve_shape,
    sqrt_plan,
)
from flashckpt.memory.estimate import OPTIMIZER_IMPLS, OPTIMIZERS
from flashckpt.memory.gpus import GPU
from flashckpt.memory.hf import build_hf_model, hf_config, transformers_available
from flashckpt.memory.recompute.planner import RecomputePlan
from flashckpt.memory.sizing import FormulaSizer, TracedSizer, largest_batch
from flashckpt.memory.units import format_bytes, parse_bytes
from flashckpt.store.files import safeopen
from flashckpt.store.files.jsonfile import load_object

log = logging.getLogger(__name__)

MAX_GPUS = 4096
Sizer = FormulaSizer | TracedSizer


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "plan",
        help="will a model fit on a GPU: memory breakdown, recompute plan, batch size, GPU count",
        description="Estimate per-GPU training memory and plan around it (docs/guides/memory.md).",
    )
    p.add_argument(
        "--model", required=True, help=f"a name ({', '.join(known_shapes())}) or CONFIG.json"
    )
    p.add_argument(
        "--gpu",
        default=None,
        help=f"GPU type: {', '.join(known_gpus())}; without it, a CPU run in this machine's memory",
    )
    p.add_argument("--batch", type=argtypes.count, required=True, help="micro-batch size per GPU")
    p.add_argument("--seq", type=argtypes.count, required=True, help="sequence length in tokens")
    p.add_argument("--precision", default="bf16-mixed", choices=PRECISIONS)
    p.add_argument("--optimizer", default="adamw", choices=OPTIMIZERS)
    p.add_argument("--optimizer-impl", default="foreach", choices=OPTIMIZER_IMPLS)
    p.add_argument("--optimizer-offload", action="store_true", help="optimizer state on CPU")
    p.add_argument(
        "--trainable-fraction", type=argtypes.fraction, default=1.0, help="e.g. 0.01 for LoRA"
    )
    p.add_argument(
        "--grad-accum", type=argtypes.count, default=1, help="micro-batches per optimizer step"
    )
    p.add_argument("--dropout", choices=("on", "off"), default=None, help="default: the config's")
    p.add_argument("--zero", type=int, default=0, choices=(0, 1, 2, 3), help="ZeRO stage (FSDP=3)")
    p.add_argument(
        "--world-size", type=argtypes.count, default=None, help="GPUs in the job (default 1)"
    )
    p.add_argument(
        "--tp", type=argtypes.count, default=1, help="tensor-parallel degree (formula only)"
    )
    p.add_argument("--sp", action="store_true", help="sequence parallelism (with --tp)")
    p.add_argument("--no-flash-attention", action="store_true", help="eager attention (formula)")
    p.add_argument("--method", default="auto", choices=("auto", "traced", "formula"))
    p.add_argument("--gpu-memory", default=None, help="override the GPU's memory, e.g. 20GiB")
    p.add_argument("--gpu-hour-price", type=argtypes.price, default=None, help="USD per GPU-hour")
    p.set_defaults(func=run)


def _base(args: argparse.Namespace, traced: bool) -> dict[str, Any]:
    base = {
        "seq_len": args.seq,
        "precision": args.precision,
        "optimizer": args.optimizer,
        "optimizer_impl": args.optimizer_impl,
        "optimizer_offload": args.optimizer_offload,
        "grad_accum": args.grad_accum,
        "trainable_fraction": args.trainable_fraction,
    }
    if not traced:  # the traced model carries its own attention kernel and dropout
        base |= {
            "tensor_parallel": args.tp,
            "sequence_parallel": args.sp,
            "flash_attention": not args.no_flash_attention,
            "dropout": args.dropout == "on",
        }
    return base


def _why_not_traced(args: argparse.Namespace) -> str | None:
    if args.method == "formula":
        return "--method formula"
    if not transformers_available():
        return "transformers is not installed"
    if args.tp > 1 or args.sp:
        return "tensor parallelism is not traced"
    if args.trainable_fraction != 1.0:
        return "--trainable-fraction is a formula option"
    return None


def _model(args: argparse.Namespace) -> Any:
    """``--model``: a catalog name, or a config.json read through the file gateway (a regular
    file of bounded size: a FIFO, /dev/urandom or a sparse file is refused, never read)."""
    path = args.model
    if not path.endswith(".json"):
        return path
    try:
        data = safeopen.read_path(path, max_bytes=16 << 20, what="model config")
    except FileNotFoundError:
        raise ConfigError(f"model config {path} does not exist; give a config.json") from None
    return load_object(data, where=path, max_bytes=16 << 20, error=ConfigError)


def _sizer(args: argparse.Namespace) -> tuple[Sizer, str]:
    why = _why_not_traced(args)
    if why is None:
        try:
            dropout = None if args.dropout is None else args.dropout == "on"
            model = build_hf_model(hf_config(_model(args)), dropout=dropout)
            device = "cpu" if args.gpu is None else None
            sizer = TracedSizer(model, device=device, **_base(args, traced=True))
            return sizer, "traced: one real training step of the HF model on fake tensors"
        except ConfigError as exc:
            if args.method == "traced":
                raise
            why = f"cannot build the model ({exc})"
    if args.method == "traced":
        raise ConfigError(f"--method traced is not possible here: {why}")
    if args.gpu is None:
        raise ConfigError(
            f"a CPU run is sized by tracing the model, which is not possible here ({why}); "
            "pass --gpu NAME to size a GPU run with the formulas"
        )
    formula = FormulaSizer(resolve_shape(_model(args)), **_base(args, traced=False))
    return formula, f"formula estimate (closed forms; {why})"


def _header(args: argparse.Namespace, sizer: Sizer, gpu: GPU, gpu_bytes: int, how: str) -> str:
    world = args.world_size or args.tp
    if isinstance(sizer, TracedSizer):
        params = sum(p.numel() for p in sizer.model.parameters())
        cfg: Any = sizer.model.config
        desc = f"{cfg.model_type}, {len(sizer.blocks)} blocks, vocab {cfg.vocab_size}"
    else:
        shape = sizer.shape
        params = shape.num_params
        desc = f"{shape.layers} layers, hidden {shape.hidden}, heads {shape.heads}"
        desc += f", vocab {shape.vocab}"
    return (
        f"{args.model}: {params / 1e9:.2f}B params, {desc}\n"
        f"{gpu.label} ({format_bytes(gpu_bytes)}); batch {args.batch} x seq {args.seq}"
        f"{f' x {args.grad_accum} micro-batches' if args.grad_accum > 1 else ''}; "
        f"{args.precision}, {args.optimizer} ({args.optimizer_impl}), ZeRO-{args.zero}, "
        f"{world} GPU(s), tp {args.tp}\n{how}"
    )


def _breakdown(est: MemoryEstimate, memory_bytes: int) -> list[str]:
    lines = [f"  {key:<22}{format_bytes(val):>12}" for key, val in est.breakdown.items()]
    verdict = "FITS" if est.fits(memory_bytes) else "DOES NOT FIT"
    gap = memory_bytes - est.peak_bytes
    tail = f"headroom {format_bytes(gap)}" if gap >= 0 else f"short by {format_bytes(-gap)}"
    lines.append(
        f"  {'peak (phase-aware)':<22}{format_bytes(est.peak_bytes):>12}  {verdict} ({tail})"
    )
    lines += [f"  note: {note}" for note in est.notes]
    return lines


def _find_plan(
    sizer: Sizer, est: MemoryEstimate, gpu: GPU, gpu_bytes: int, dims: dict[str, Any]
) -> tuple[RecomputePlan | None, MemoryEstimate | None, Any, str]:
    """The cheapest plan whose whole step fits, checked by the sizer; or why there is none.

    One answer with the rest of the output: a plan exists exactly when recomputing every
    block fits (what "largest batch, full recompute" and "fewest GPUs" ask the same sizer).
    Then the activation budget handed to the planner is bisected between the all-blocks plan
    (fits) and no recompute (does not), each candidate plan checked as a whole step.
    """
    prof = sizer.profile(tflops=gpu.bf16_tflops, **dims)
    every = evaluate_plan(prof, [b.name for b in prof.blocks], method="all blocks")
    full = sizer.estimate(recompute="full", **dims)
    if not full.fits(gpu_bytes):
        return (
            None,
            None,
            prof,
            (
                f"recompute cannot help: even recomputing every block the step needs "
                f"{format_bytes(full.peak_bytes)} (model states, logits and the activations no "
                "block holds)"
            ),
        )
    best: tuple[RecomputePlan, MemoryEstimate] = (every, full)
    lo, hi = every.activation_bytes, est.breakdown["activations"]  # fits / does not fit
    tries = 6 if isinstance(sizer, TracedSizer) else 24
    for _ in range(tries):
        if hi - lo <= max(1, hi // 200):
            break
        mid = (lo + hi) // 2
        try:
            plan = plan_recompute(prof, mid)
        except MemoryPlanError:
            lo = mid
            continue
        with_plan = sizer.estimate(recompute=plan, **dims)
        if with_plan.fits(gpu_bytes):
            lo = mid
            if plan.recompute_s <= best[0].recompute_s:
                best = (plan, with_plan)
        else:
            hi = mid
    return best[0], best[1], prof, ""


def _recompute(
    sizer: Sizer, est: MemoryEstimate, gpu: GPU, gpu_bytes: int, dims: dict[str, Any]
) -> tuple[list[str], RecomputePlan | None, MemoryEstimate | None]:
    lines = ["", "recompute (activation checkpointing, per block)"]
    plan, with_plan, prof, why = _find_plan(sizer, est, gpu, gpu_bytes, dims)
    if plan is None or with_plan is None:
        return [*lines, f"  {why}"], None, None
    share = plan.recompute_s / prof.forward_s if prof.forward_s else 0.0
    names = ", ".join(plan.recompute[:6]) + (" ..." if len(plan.recompute) > 6 else "")
    lines.append(f"  recompute {len(plan.recompute)} of {len(prof.blocks)} blocks: {names}")
    lines.append(
        f"  cost: +{plan.recompute_s * 1e3:.1f} ms/step (+{share:.0%} of forward, est. at 40% MFU)"
    )
    lines.append(f"  peak with plan: {format_bytes(with_plan.peak_bytes)}  FITS")
    for base in (every_k_plan(prof, k=2), sqrt_plan(prof)):
        whole = sizer.estimate(recompute=base, **dims)
        ok = "fits" if whole.fits(gpu_bytes) else "does not fit"
        lines.append(
            f"  baseline {base.method:<8} {len(base.recompute):>3} blocks, "
            f"+{base.recompute_s * 1e3:.1f} ms, peak {format_bytes(whole.peak_bytes)} ({ok})"
        )
    return lines, plan, with_plan


def _largest(sizer: Sizer, gpu_bytes: int, dims: dict[str, Any], recompute: Any) -> int | None:
    opts = {k: v for k, v in dims.items() if k != "batch_size"} | {"recompute": recompute}
    return largest_batch(sizer, lambda est: est.fits(gpu_bytes), **opts)


def _largest_batch(
    sizer: Sizer, gpu_bytes: int, dims: dict[str, Any], plan: RecomputePlan | None
) -> list[str]:
    lines = ["", "largest batch per GPU that fits"]
    rows: list[tuple[str, Any]] = [("no recompute", None)]
    if plan is not None:
        rows.append((f"plan above ({len(plan.recompute)})", plan))
    rows.append(("full recompute", "full"))
    for label, rec in rows:
        b = _largest(sizer, gpu_bytes, dims, rec)
        lines.append(f"  {label:<20}{b if b is not None else 'none (batch 1 does not fit)'}")
    return lines


def _fewest_gpus(
    sizer: Sizer, args: argparse.Namespace, gpu: GPU, gpu_bytes: int, dims: dict[str, Any]
) -> list[str]:
    price = args.gpu_hour_price if args.gpu_hour_price is not None else gpu.usd_per_hour
    note = "" if args.gpu_hour_price is not None else " (typical list price)"
    lines = [
        "",
        f"fewest {gpu.name} GPUs that fit, batch {args.batch}/GPU, ${price:.2f}/GPU-h{note}",
    ]
    for stage in (0, 1, 2, 3):
        found = _fewest(sizer, args, stage, gpu_bytes, dims)
        if found is None:
            lines.append(f"  ZeRO-{stage}: does not fit on up to {MAX_GPUS} GPUs, even recomputed")
            continue
        n, rec = found
        how = "" if rec is None else "  (recompute every block)"
        lines.append(f"  ZeRO-{stage}: {n:>5} GPU(s)  ${n * price:,.2f}/h{how}")
    return lines


def _fewest(
    sizer: Sizer, args: argparse.Namespace, stage: int, gpu_bytes: int, dims: dict[str, Any]
) -> tuple[int, Any] | None:
    """Smallest GPU count (and the recompute it needs: None, else 'full') that fits."""
    best: tuple[int, Any] | None = None
    for rec in (None, "full"):

        def fits(n: int, rec: Any = rec) -> bool:
            opts = dims | {"zero_stage": stage, "world_size": n * args.tp, "recompute": rec}
            return sizer.estimate(**opts).fits(gpu_bytes)

        top = MAX_GPUS // args.tp
        if not fits(top):
            continue
        lo, hi = 0, top  # fits(hi); find the smallest
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if fits(mid) else (mid, hi)
        if best is None or hi * args.tp < best[0]:
            best = (hi * args.tp, rec)
    return best


def _host_gpu(args: argparse.Namespace) -> GPU:
    """This machine's CPU as the device of a CPU run: its physical memory is the budget."""
    if args.gpu_memory:
        memory = parse_bytes(args.gpu_memory, name="--gpu-memory")
    else:
        try:
            memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError, AttributeError) as exc:
            raise ConfigError(
                f"cannot read this machine's memory ({exc}); pass --gpu-memory SIZE or --gpu NAME"
            ) from exc
    # bf16_tflops only prices recompute time; a CPU core does well under a TFLOP/s
    return GPU(
        name="cpu",
        label="CPU run (host memory)",
        memory_bytes=memory,
        bf16_tflops=1.0,
        usd_per_hour=0.0,
    )


def run(args: argparse.Namespace) -> int:
    gpu = gpu_by_name(args.gpu) if args.gpu is not None else _host_gpu(args)
    gpu_bytes = (
        parse_bytes(args.gpu_memory, name="--gpu-memory") if args.gpu_memory else gpu.memory_bytes
    )
    sizer, how = _sizer(args)
    world = args.world_size or args.tp
    dims = {"batch_size": args.batch, "zero_stage": args.zero, "world_size": world}
    est = sizer.estimate(**dims)
    print(_header(args, sizer, gpu, gpu_bytes, how))
    print("\nmemory per GPU")
    lines = _breakdown(est, gpu_bytes)
    fitting: MemoryEstimate | None = est if est.fits(gpu_bytes) else None
    plan = None
    if fitting is None:
        more, plan, fitting = _recompute(sizer, est, gpu, gpu_bytes, dims)
        lines += more
    if args.gpu is not None:
        lines += _preallocate(fitting, plan, gpu_bytes)
    lines += _largest_batch(sizer, gpu_bytes, dims, plan)
    if args.world_size is None and args.gpu is not None:
        lines += _fewest_gpus(sizer, args, gpu, gpu_bytes, dims)
    print("\n".join(lines))
    return 0


def _preallocate(
    fitting: MemoryEstimate | None, plan: RecomputePlan | None, gpu_bytes: int
) -> list[str]:
    lines = ["", "preallocate"]
    if fitting is None:
        return [*lines, "  nothing to reserve: no setup above fits this GPU"]
    settings = recommend_allocator_settings(peak_bytes=fitting.peak_bytes, device_bytes=gpu_bytes)
    reserve = int(min(fitting.allocated_peak_bytes * 1.05, gpu_bytes - fitting.context_bytes))
    which = "" if plan is None else f", with the {len(plan.recompute)}-block plan"
    return [
        *lines,
        f"  reserve {format_bytes(reserve)} up front (allocated peak + 5%{which}): "
        "flashckpt.memory.preallocate(estimate)",
        f"  PYTORCH_CUDA_ALLOC_CONF={settings.conf_string()}",
    ]
