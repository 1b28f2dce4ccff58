"""The demo's narrated steps: planning memory and showing the report."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

from flashckpt.units import format_bytes


def say(text: str) -> None:
    print(text, flush=True)


def plan_memory(cfg: dict[str, Any]) -> list[str]:
    """Estimate, profile and plan recompute for the demo model; returns blocks to recompute."""
    from flashckpt.demo.data import CharTokenizer, load_corpus
    from flashckpt.demo.model import GPT, GPTConfig
    from flashckpt.memory import TransformerShape, estimate, plan_recompute, profile

    say("\n[1/4] memory plan")
    vocab = CharTokenizer.from_text(load_corpus()).vocab_size
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=vocab, **cfg["model"]))
    b, s = cfg["batch_size"], cfg["block_size"]
    m = cfg["model"]
    shape = TransformerShape(
        m["n_layer"],
        m["n_embd"],
        m["n_head"],
        vocab,
        qkv_bias=True,
        max_seq_len=m["block_size"],
        name="demo-gpt",
    )
    flash = torch.cuda.is_available()  # on CPU attention takes the plain (non-flash) path
    est = estimate(
        shape, batch_size=b, seq_len=s, precision="fp32", optimizer="adamw", flash_attention=flash
    )
    say(
        f"  model: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters, batch {b}, "
        f"sequence {s}, fp32 + AdamW"
    )
    for key, val in est.breakdown.items():
        if val:
            say(f"    {key:<22}{format_bytes(val):>12}")
    say(f"    {'estimated peak':<22}{format_bytes(est.peak_bytes):>12}")
    idx = torch.randint(0, vocab, (b, s))
    prof = profile(model, idx)
    full = sum(blk.activation_bytes for blk in prof.blocks)
    budget = int(full * 0.75)
    plan = plan_recompute(prof, budget)
    say(
        f"  measured (saved-tensor hooks) activations of {len(prof.blocks)} blocks: "
        f"{format_bytes(full)}, dropout masks included; "
        f"demo budget {format_bytes(budget)} (75%)"
    )
    say(f"  plan: {plan.describe()} — applied to the model that trains below")
    from flashckpt.memory import preallocate

    say(f"  preallocation: {preallocate(est).explain()}")
    return list(plan.recompute)


def show_report(cfg: dict[str, Any], out: Path) -> None:
    from flashckpt.report import summarize, write_report
    from flashckpt.report.summary import load_events
    from flashckpt.report.terminal import format_status

    say("\n[4/4] report")
    report = write_report(cfg["disk"], output=out / "report.html")
    say(format_status(summarize(load_events(cfg["disk"])), root=cfg["disk"]))
    say(f"\n  report: {report}")
    say("  look inside:")
    for cmd in (
        f"flashckpt ls {cfg['disk']}",
        f"flashckpt inspect {cfg['disk']}",
        f"flashckpt verify {cfg['disk']}",
        f"flashckpt report {cfg['disk']}",
    ):
        say(f"    {cmd}")
    subprocess.run([sys.executable, "-m", "flashckpt.cli", "ls", cfg["disk"]], check=False)
    if cfg.get("memory"):  # it lives in RAM: a demo should not keep holding it
        shutil.rmtree(cfg["memory"], ignore_errors=True)
        say(f"  removed the memory tier {cfg['memory']} (RAM); every step above is also on disk")
