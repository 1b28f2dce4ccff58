"""``flashckpt plan``: will a model, batch and sequence length fit on a GPU; if not, what then."""

from __future__ import annotations

import argparse
import logging
from typing import Any

from flashckpt.memory import (
    PRECISIONS,
    MemoryEstimate,
    MemoryPlanError,
    estimate,
    every_k_plan,
    gpu_by_name,
    known_gpus,
    known_shapes,
    model_max_batch_size,
    plan_recompute,
    recommend_allocator_settings,
    resolve_shape,
    shape_profile,
    sqrt_plan,
)
from flashckpt.memory.estimate import OPTIMIZERS
from flashckpt.memory.gpus import GPU
from flashckpt.memory.recompute import RecomputePlan
from flashckpt.memory.units import format_bytes, parse_bytes

log = logging.getLogger(__name__)

MAX_GPUS = 4096


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "plan",
        help="will a model fit on a GPU: memory breakdown, recompute plan, batch size, GPU count",
        description="Estimate per-GPU training memory and plan around it (README: Memory).",
    )
    p.add_argument(
        "--model", required=True, help=f"a name ({', '.join(known_shapes())}) or CONFIG.json"
    )
    p.add_argument("--gpu", required=True, help=f"GPU type: {', '.join(known_gpus())}")
    p.add_argument("--batch", type=int, required=True, help="micro-batch size per GPU")
    p.add_argument("--seq", type=int, required=True, help="sequence length in tokens")
    p.add_argument("--precision", default="bf16-mixed", choices=PRECISIONS)
    p.add_argument("--optimizer", default="adamw", choices=OPTIMIZERS)
    p.add_argument("--zero", type=int, default=0, choices=(0, 1, 2, 3), help="ZeRO stage (FSDP=3)")
    p.add_argument("--world-size", type=int, default=None, help="GPUs in the job (default 1)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree")
    p.add_argument("--sp", action="store_true", help="sequence parallelism (with --tp)")
    p.add_argument("--no-flash-attention", action="store_true", help="eager attention (s^2 memory)")
    p.add_argument("--gpu-memory", default=None, help="override the GPU's memory, e.g. 20GiB")
    p.add_argument("--gpu-hour-price", type=float, default=None, help="USD per GPU-hour")
    p.set_defaults(func=run)


def _options(args: argparse.Namespace, **overrides: Any) -> dict[str, Any]:
    opts = {
        "seq_len": args.seq,
        "precision": args.precision,
        "optimizer": args.optimizer,
        "zero_stage": args.zero,
        "world_size": args.world_size or args.tp,
        "tensor_parallel": args.tp,
        "sequence_parallel": args.sp,
        "flash_attention": not args.no_flash_attention,
    }
    opts.update(overrides)
    return opts


def _breakdown(est: MemoryEstimate, memory_bytes: int) -> list[str]:
    lines = [f"  {key:<22}{format_bytes(val):>12}" for key, val in est.breakdown.items()]
    verdict = "FITS" if est.fits(memory_bytes) else "DOES NOT FIT"
    gap = memory_bytes - est.peak_bytes
    tail = f"headroom {format_bytes(gap)}" if gap >= 0 else f"short by {format_bytes(-gap)}"
    lines.append(
        f"  {'peak (phase-aware)':<22}{format_bytes(est.peak_bytes):>12}  {verdict} ({tail})"
    )
    return lines


def _recompute(
    shape: Any, args: argparse.Namespace, est: MemoryEstimate, gpu_bytes: int
) -> list[str]:
    opts = _options(args, batch_size=args.batch)
    prof = shape_profile(shape, **opts)
    frag = est.options.fragmentation_fraction
    budget = est.breakdown["activations"] - int((est.peak_bytes - gpu_bytes) / (1 + frag))
    lines = ["", "recompute (activation checkpointing, per block)"]
    plan: RecomputePlan | None = None
    if budget <= prof.other_activation_bytes:
        static = est.peak_bytes - est.breakdown["activations"] - est.breakdown["logits"]
        return [
            *lines,
            f"  recompute cannot help: model states, logits and slack alone need about "
            f"{format_bytes(static + est.breakdown['logits'])}; use ZeRO-3/more GPUs (see below)",
        ]
    for _ in range(8):  # shrink the budget until the whole step fits
        try:
            plan = plan_recompute(prof, max(budget, 0))
        except MemoryPlanError as exc:
            return [*lines, f"  no plan fits: {exc}"]
        if estimate(shape, recompute=plan, **opts).fits(gpu_bytes):
            break
        budget -= max(1, prof.blocks[0].activation_bytes // 4)
    if plan is None:  # unreachable: the loop runs at least once
        return lines
    with_plan = estimate(shape, recompute=plan, **opts)
    if not with_plan.fits(gpu_bytes):
        return [*lines, "  even recomputing every block does not fit; shard or use more GPUs"]
    share = plan.recompute_s / prof.forward_s if prof.forward_s else 0.0
    names = ", ".join(plan.recompute[:6]) + (" ..." if len(plan.recompute) > 6 else "")
    lines.append(f"  recompute {len(plan.recompute)} of {len(prof.blocks)} blocks: {names}")
    lines.append(
        f"  cost: +{plan.recompute_s * 1e3:.1f} ms/step (+{share:.0%} of forward, est. at 40% MFU)"
    )
    lines.append(f"  peak with plan: {format_bytes(with_plan.peak_bytes)}  FITS")
    for base in (every_k_plan(prof, k=2), sqrt_plan(prof)):
        ok = "fits" if base.activation_bytes <= plan.activation_bytes else "too big"
        lines.append(
            f"  baseline {base.method:<8} {len(base.recompute):>3} blocks, "
            f"+{base.recompute_s * 1e3:.1f} ms, "
            f"activations {format_bytes(base.activation_bytes)} ({ok})"
        )
    return lines


def _largest_batch(shape: Any, args: argparse.Namespace, gpu_bytes: int) -> list[str]:
    lines = ["", "largest batch per GPU that fits"]
    for label, rec in (("no recompute", None), ("full recompute", "full")):
        try:
            b = model_max_batch_size(shape, budget_bytes=gpu_bytes, **_options(args, recompute=rec))
            lines.append(f"  {label:<16}{b}")
        except MemoryPlanError:
            lines.append(f"  {label:<16}none (batch 1 does not fit)")
    return lines


def _fewest_gpus(shape: Any, args: argparse.Namespace, gpu: GPU, gpu_bytes: int) -> list[str]:
    price = args.gpu_hour_price if args.gpu_hour_price is not None else gpu.usd_per_hour
    note = "" if args.gpu_hour_price is not None else " (typical list price)"
    lines = [
        "",
        f"fewest {gpu.name} GPUs that fit, batch {args.batch}/GPU, ${price:.2f}/GPU-h{note}",
    ]
    for stage in (0, 1, 2, 3):

        def fits(n: int, stage: int = stage) -> bool:
            opts = _options(args, batch_size=args.batch, zero_stage=stage, world_size=n * args.tp)
            return estimate(shape, **opts).fits(gpu_bytes)

        if not fits(MAX_GPUS // args.tp):
            lines.append(f"  ZeRO-{stage}: does not fit on up to {MAX_GPUS} GPUs")
            continue
        lo, hi = 0, MAX_GPUS // args.tp  # fits(hi); find the smallest
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if fits(mid) else (mid, hi)
        n = hi * args.tp
        lines.append(f"  ZeRO-{stage}: {n:>5} GPU(s)  ${n * price:,.2f}/h")
    return lines


def run(args: argparse.Namespace) -> int:
    shape = resolve_shape(args.model)
    gpu = gpu_by_name(args.gpu)
    gpu_bytes = (
        parse_bytes(args.gpu_memory, name="--gpu-memory") if args.gpu_memory else gpu.memory_bytes
    )
    est = estimate(shape, **_options(args, batch_size=args.batch))
    world = args.world_size or args.tp
    print(
        f"{shape.name or args.model}: {shape.num_params / 1e9:.2f}B params, {shape.layers} layers, "
        f"hidden {shape.hidden}, heads {shape.heads}, vocab {shape.vocab}"
    )
    print(
        f"{gpu.label} ({format_bytes(gpu_bytes)}); batch {args.batch} x seq {args.seq}; "
        f"{args.precision}, {args.optimizer}, ZeRO-{args.zero}, {world} GPU(s), tp {args.tp}"
    )
    print("\nmemory per GPU")
    lines = _breakdown(est, gpu_bytes)
    if not est.fits(gpu_bytes):
        lines += _recompute(shape, args, est, gpu_bytes)
    settings = recommend_allocator_settings(peak_bytes=est.peak_bytes, device_bytes=gpu_bytes)
    reserve = int(min(est.allocated_peak_bytes * 1.05, gpu_bytes - est.context_bytes))
    lines += [
        "",
        "preallocate",
        f"  reserve {format_bytes(reserve)} up front (allocated peak + 5%): "
        "flashckpt.memory.preallocate(estimate)",
        f"  PYTORCH_CUDA_ALLOC_CONF={settings.conf_string()}",
    ]
    lines += _largest_batch(shape, args, gpu_bytes)
    if args.world_size is None:
        lines += _fewest_gpus(shape, args, gpu, gpu_bytes)
    print("\n".join(lines))
    return 0
