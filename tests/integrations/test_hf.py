"""Hugging Face Trainer: save through flashckpt, resume bitwise identically (tiny GPT-2)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
import accelerate  # noqa: F401  (transformers.Trainer needs it; in the test extra)
import transformers

from flashckpt.errors import ConfigError, NoCheckpointError
from flashckpt.integrations.hf import FlashCkptCallback, _loading_from, resume

TOTAL = 10


class Tokens(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    def __init__(self, n: int = 24, seq: int = 16) -> None:
        g = torch.Generator().manual_seed(1)
        self.ids = torch.randint(0, 100, (n, seq), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class StopAt(transformers.TrainerCallback):  # type: ignore[misc]
    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        if state.global_step >= self.step:
            control.should_training_stop = True


def _trainer(tmp: Path, root: Path, *extra: Any, save_steps: int = 4, **overrides: Any) -> Any:
    """A Trainer of a tiny GPT-2 with the flashckpt callback; ``overrides`` go to
    ``TrainingArguments`` (the DDP worker sets the batch size and the gloo backend)."""
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=16, resid_pdrop=0.1
    )
    model = transformers.GPT2LMHeadModel(cfg)
    args = transformers.TrainingArguments(
        output_dir=str(tmp / "out"),
        max_steps=TOTAL,
        learning_rate=1e-3,
        logging_steps=2,
        save_strategy="steps",
        save_steps=save_steps,
        report_to=[],
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
        **{"per_device_train_batch_size": 4, **overrides},
    )
    cb = FlashCkptCallback(root, async_save=True)
    return transformers.Trainer(
        model=model, args=args, train_dataset=Tokens(), callbacks=[cb, *extra]
    )


def _losses(trainer: Any, after: int) -> dict[int, float]:
    return {
        h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h and h["step"] > after
    }


@pytest.mark.parametrize("stop", [4, 6], ids=["mid-epoch", "epoch-boundary"])
def test_resume_is_bitwise_identical(tmp_path: Path, stop: int) -> None:
    straight = _trainer(tmp_path / "a", tmp_path / "a-ckpt", save_steps=stop)
    straight.train()

    first = _trainer(tmp_path / "b", tmp_path / "b-ckpt", StopAt(stop), save_steps=stop)
    first.train()
    assert first.state.global_step == stop
    assert not (tmp_path / "b" / "out" / f"checkpoint-{stop}").exists()  # no Trainer checkpoint

    second = _trainer(tmp_path / "b", tmp_path / "b-ckpt", save_steps=stop)
    resume(second)
    assert second.state.global_step == TOTAL
    for (name, p), q in zip(straight.model.named_parameters(), second.model.parameters()):
        assert torch.equal(p, q), name
    want, got = _losses(straight, stop), _losses(second, stop)
    assert want and got == want
    cb = next(c for c in second.callback_handler.callbacks if isinstance(c, FlashCkptCallback))
    assert cb.checkpointer().steps()[-1] == TOTAL
    cb.close()


def test_resume_without_checkpoint_trains_fresh(tmp_path: Path) -> None:
    trainer = _trainer(tmp_path, tmp_path / "ckpt", StopAt(2))
    resume(trainer)
    assert trainer.state.global_step == 2


def test_resume_errors(tmp_path: Path) -> None:
    trainer = _trainer(tmp_path, tmp_path / "ckpt")
    with pytest.raises(NoCheckpointError, match="step 3 is not in"):
        resume(trainer, step=3)
    with pytest.raises(ConfigError, match="pass step="):
        resume(trainer, resume_from_checkpoint="x")
    trainer.callback_handler.remove_callback(FlashCkptCallback)
    with pytest.raises(ConfigError, match="no FlashCkptCallback"):
        resume(trainer)


def _tiny_gpt2() -> Any:
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50, n_positions=8)
    return transformers.GPT2LMHeadModel(cfg)


def test_callback_saves_instead_of_trainer_and_loaders_restore(tmp_path: Path) -> None:
    """Without a Trainer run: the callback's save and the patched loaders, on real HF objects."""
    model = _tiny_gpt2()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    model(torch.randint(0, 50, (2, 8)), labels=torch.randint(0, 50, (2, 8))).loss.backward()
    opt.step()
    sched.step()
    state = transformers.TrainerState(global_step=7, epoch=1.5, log_history=[{"loss": 1.0}])
    control = transformers.TrainerControl(should_save=True)
    cb = FlashCkptCallback(tmp_path / "ckpt", async_save=True)
    kw = {"model": model, "optimizer": opt, "lr_scheduler": sched}
    rng_at_save = torch.get_rng_state()
    cb.on_step_end(None, state, control, **kw)
    assert control.should_save is False
    cb.on_epoch_end(None, state, control, **kw)  # nothing to do: should_save is False now
    control.should_save = True
    cb.on_epoch_end(None, state, control, **kw)  # same step again: not saved twice
    cb.on_train_end(None, state, control)
    ckpt = cb.checkpointer()
    assert ckpt.steps() == [7]

    holder: dict[str, Any] = {"trainer": None}
    ckpt.restore(holder)
    restored = transformers.TrainerState(**holder["trainer"])
    assert restored.global_step == 7 and restored.log_history == [{"loss": 1.0}]
    assert "TrainerControl" in holder["trainer"]["stateful_callbacks"]

    fresh = _tiny_gpt2()
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.01)
    fresh_sched = torch.optim.lr_scheduler.LambdaLR(fresh_opt, lambda s: 1.0 / (1 + s))

    class FakeTrainer:
        model, optimizer, lr_scheduler = fresh, fresh_opt, fresh_sched

        def _load_rng_state(self, checkpoint: Any) -> None:
            raise AssertionError("original loader called")

    trainer = FakeTrainer()
    with _loading_from(trainer, ckpt, 7):
        trainer._load_from_checkpoint("ignored")  # type: ignore[attr-defined]
        trainer._load_optimizer_and_scheduler("ignored")  # type: ignore[attr-defined]
        torch.manual_seed(999)
        trainer._load_rng_state("ignored")
        assert torch.equal(torch.get_rng_state(), rng_at_save)
    assert "_load_rng_state" not in vars(trainer)  # unpatched again
    cb.close()
    for k, v in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[k], v), k
    assert fresh_sched.state_dict()["last_epoch"] == 1
    assert torch.equal(
        fresh_opt.state_dict()["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"]
    )
