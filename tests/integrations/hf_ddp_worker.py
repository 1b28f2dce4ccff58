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

sys.path.insert(0, str(Path(__file__).parent))
from test_hf import StopAt, _losses, _trainer

from flashckpt.integrations.hf import resume

STOP = 4


def trainer(tmp: Path, root: Path, *extra: Any) -> Any:
    return _trainer(
        tmp, root, *extra, save_steps=STOP, per_device_train_batch_size=2, ddp_backend="gloo"
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
