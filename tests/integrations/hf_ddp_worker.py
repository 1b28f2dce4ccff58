"""One rank of the Hugging Face Trainer DDP test (run by tests/integrations/test_hf_ddp.py
under torchrun): ``first`` trains straight and trains a second run that stops at step 4;
``second`` resumes that run from flashckpt. Each rank writes what it ended with as JSON."""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
import torch
import transformers

sys.path.insert(0, str(Path(__file__).parent))
from test_hf import TOTAL, StopAt, Tokens, _losses

from flashckpt.integrations.hf import FlashCkptCallback, resume

STOP = 4


def trainer(tmp: Path, root: Path, *extra: Any) -> Any:
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=16, resid_pdrop=0.1
    )
    args = transformers.TrainingArguments(
        output_dir=str(tmp / "out"),
        max_steps=TOTAL,
        per_device_train_batch_size=2,
        learning_rate=1e-3,
        logging_steps=2,
        save_strategy="steps",
        save_steps=STOP,
        report_to=[],
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
        ddp_backend="gloo",
    )
    cb = FlashCkptCallback(root, async_save=True)
    model = transformers.GPT2LMHeadModel(cfg)
    return transformers.Trainer(
        model=model, args=args, train_dataset=Tokens(), callbacks=[cb, *extra]
    )


def digests(model: torch.nn.Module) -> dict[str, str]:
    return {
        n: hashlib.sha256(p.detach().contiguous().numpy().tobytes()).hexdigest()
        for n, p in model.named_parameters()
    }


def main(phase: str, tmp: Path) -> None:
    rank = int(os.environ["RANK"])
    if phase == "first":
        straight = trainer(tmp / "a", tmp / "a-ckpt")
        straight.train()
        first = trainer(tmp / "b", tmp / "b-ckpt", StopAt(STOP))
        first.train()
        out = {
            "params": digests(straight.model),
            "losses": _losses(straight, STOP),
            "step": first.state.global_step,
        }
    else:
        second = trainer(tmp / "b", tmp / "b-ckpt")
        resume(second)
        out = {
            "params": digests(second.model),
            "losses": _losses(second, STOP),
            "step": second.state.global_step,
        }
    (tmp / f"{phase}-rank{rank}.json").write_text(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
