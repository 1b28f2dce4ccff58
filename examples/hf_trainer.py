"""Hugging Face Trainer with flashckpt: run it twice; the second run resumes bitwise.

    pip install 'flashckpt[hf]'          # transformers + accelerate
    HF_HUB_OFFLINE=1 python examples/hf_trainer.py --dir runs/hf --stop-at 20
    HF_HUB_OFFLINE=1 python examples/hf_trainer.py --dir runs/hf       # resumes at step 20

A small GPT-2 built from a config (nothing downloaded) trained on random tokens.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch
import transformers

from flashckpt.integrations.hf import FlashCkptCallback, resume


class RandomTokens(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    def __init__(self, n: int = 256, seq: int = 32, vocab: int = 128) -> None:
        self.ids = torch.randint(0, vocab, (n, seq), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class StopAt(transformers.TrainerCallback):  # type: ignore[misc]
    """Simulates a crash: stop training after ``step`` steps."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        if self.step and state.global_step >= self.step:
            control.should_training_stop = True


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default="runs/hf")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--stop-at", type=int, default=0, help="stop early (simulated crash)")
    args = ap.parse_args()
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=32)
    model = transformers.GPT2LMHeadModel(cfg)
    targs = transformers.TrainingArguments(
        output_dir=args.dir,
        max_steps=args.steps,
        per_device_train_batch_size=8,
        logging_steps=5,
        save_strategy="steps",
        save_steps=10,  # Trainer decides when; flashckpt does the saving
        report_to=[],
        seed=0,
    )
    trainer = transformers.Trainer(
        model=model,
        args=targs,
        train_dataset=RandomTokens(),
        callbacks=[
            FlashCkptCallback(Path(args.dir) / "flashckpt", async_save=True, keep=3),
            StopAt(args.stop_at),
        ],
    )
    resume(trainer)  # newest flashckpt step, or a fresh start when there is none
    print(f"done at step {trainer.state.global_step}; try: flashckpt ls {args.dir}/flashckpt")


if __name__ == "__main__":
    main()
