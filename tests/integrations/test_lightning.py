"""Lightning: FlashCkptIO saves through flashckpt; a new Trainer resumes from it."""

from __future__ import annotations

import enum
import json
import pathlib
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch

from flashckpt.errors import ConfigError, UnsupportedStateError
from flashckpt.integrations.lightning import FlashCkptIO, read_pointer


class Mode(enum.Enum):
    FAST = "fast"


class Tiny(L.LightningModule):  # type: ignore[misc]
    def __init__(self, width: int = 8, mode: Mode = Mode.FAST, data: Any = None) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(width, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)
        )

    def training_step(self, batch: Any, _idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=0.01)
        return [opt], [torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)]


def _loader() -> torch.utils.data.DataLoader[Any]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(40, 8, generator=g)
    ds = torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True))
    return torch.utils.data.DataLoader(ds, batch_size=8, shuffle=False)


def _trainer(tmp: Path, epochs: int, **kw: Any) -> Any:
    return L.Trainer(
        default_root_dir=str(tmp),
        max_epochs=epochs,
        plugins=[FlashCkptIO(tmp / "store", async_save=True)],
        enable_checkpointing=True,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator="cpu",
        **kw,
    )


def _module(**kw: Any) -> Tiny:
    torch.manual_seed(0)
    return Tiny(**kw)


def test_resume_matches_straight_run(tmp_path: Path) -> None:
    straight = _module()
    _trainer(tmp_path / "a", 4).fit(straight, _loader())

    first = _module()
    t1 = _trainer(tmp_path / "b", 2)
    t1.fit(first, _loader())
    ckpts = sorted((tmp_path / "b" / "checkpoints").glob("*.ckpt"))
    assert len(ckpts) == 1
    root, step = read_pointer(ckpts[0])
    assert step == t1.global_step == 10
    assert (root / "steps").is_dir()

    # The restored dict equals what Lightning saved, bitwise.
    io = FlashCkptIO(tmp_path / "b" / "store")
    loaded = io.load_checkpoint(ckpts[0])
    io.teardown()
    for k, v in first.state_dict().items():
        assert torch.equal(loaded["state_dict"][k], v), k
    assert loaded["global_step"] == 10 and loaded["epoch"] == 1
    assert loaded["hyper_parameters"]["mode"] == "fast"  # enum stored as its value
    assert len(loaded["optimizer_states"]) == 1

    second = _module()
    t2 = _trainer(tmp_path / "b", 4)
    t2.fit(second, _loader(), ckpt_path=str(ckpts[0]))
    assert t2.global_step == 20
    for (name, p), q in zip(straight.named_parameters(), second.parameters()):
        assert torch.equal(p, q), name


def test_top_k_removal_deletes_steps(tmp_path: Path) -> None:
    cb = L.pytorch.callbacks.ModelCheckpoint(
        dirpath=tmp_path / "ck", every_n_train_steps=5, save_top_k=1, monitor="step", mode="max"
    )
    trainer = _trainer(tmp_path, 2, callbacks=[cb])
    trainer.fit(_module(), _loader())
    ckpts = list((tmp_path / "ck").glob("*.ckpt"))
    assert len(ckpts) == 1
    _, step = read_pointer(ckpts[0])
    steps = sorted(int(p.name.split(".")[0]) for p in (tmp_path / "store" / "steps").glob("*.json"))
    assert steps == [step] == [10]


def test_unsupported_hparam_names_the_key(tmp_path: Path) -> None:
    trainer = _trainer(tmp_path, 1)
    with pytest.raises(UnsupportedStateError, match="hyper_parameters/data"):
        trainer.fit(_module(data=object()), _loader())


def test_path_hparam_is_converted(tmp_path: Path) -> None:
    trainer = _trainer(tmp_path, 1)
    trainer.fit(_module(data=pathlib.Path("/data/x")), _loader())
    (ckpt,) = (tmp_path / "checkpoints").glob("*.ckpt")
    io = FlashCkptIO(tmp_path / "store")
    assert io.load_checkpoint(ckpt)["hyper_parameters"]["data"] == "/data/x"
    io.teardown()


def test_load_refuses_non_pointer(tmp_path: Path) -> None:
    real = tmp_path / "real.ckpt"
    torch.save({"state_dict": {}}, real)
    with pytest.raises(ConfigError, match="not a FlashCkptIO pointer"):
        FlashCkptIO(tmp_path / "s").load_checkpoint(real)
    bad = tmp_path / "bad.ckpt"
    bad.write_text(json.dumps({"flashckpt_root": str(tmp_path), "step": -1}))
    with pytest.raises(Exception, match="invalid step"):
        read_pointer(bad)
