"""Lightning with flashckpt: run it twice; the second run resumes from the first's checkpoint.

python examples/lightning_train.py --dir runs/lit --epochs 2
python examples/lightning_train.py --dir runs/lit --epochs 4     # resumes at epoch 2

Each run resumes from the checkpoint with the highest step (``latest_checkpoint``).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import lightning as L
import torch

from flashckpt.integrations.lightning import FlashCkptIO, latest_checkpoint


class Regressor(L.LightningModule):  # type: ignore[misc]
    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(width, 64), torch.nn.GELU(), torch.nn.Linear(64, 1)
        )

    def training_step(self, batch: Any, _idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default="runs/lit")
    ap.add_argument("--epochs", type=int, default=2)
    args = ap.parse_args()
    L.seed_everything(0)
    x = torch.randn(512, 16)
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)), batch_size=32
    )
    io = FlashCkptIO(Path(args.dir) / "flashckpt", async_save=True)
    trainer = L.Trainer(
        default_root_dir=args.dir,
        max_epochs=args.epochs,
        plugins=[io],
        callbacks=[io.step_callback()],  # ticks every step: a crash's lost steps are counted
        accelerator="cpu",
        logger=False,
    )
    last = latest_checkpoint(Path(args.dir) / "checkpoints")  # newest by step, not by name
    print(f"resuming from {last.name if last else 'scratch'}", flush=True)
    trainer.fit(Regressor(), loader, ckpt_path=str(last) if last else None)
    print(f"done at step {trainer.global_step}; try: flashckpt ls {args.dir}/flashckpt")


if __name__ == "__main__":
    main()
