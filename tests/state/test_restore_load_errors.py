"""A restore whose load_state_dict would fail leaves the live state untouched and raises a
FlashCkptError naming the entry (state/restore.py).

Regression: an optimizer with other param groups than the checkpoint's let torch's plain
ValueError escape after the model's weights had already been overwritten in place."""

from __future__ import annotations

import pytest
import torch

import flashckpt
from flashckpt.errors import StateMismatchError


def _model(seed: int) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))


def _trained_opt(model: torch.nn.Module, groups: int) -> torch.optim.Optimizer:
    params = list(model.parameters())
    if groups == 2:
        opt = torch.optim.AdamW([{"params": params[:2]}, {"params": params[2:], "lr": 0.1}])
    else:
        opt = torch.optim.AdamW(params)
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
    return opt


@pytest.fixture
def saved(tmp_path):
    model = _model(0)
    opt = _trained_opt(model, groups=2)
    with flashckpt.Checkpointer(tmp_path / "ck") as ck:
        ck.save(1, {"model": model, "optim": opt})
    return tmp_path / "ck"


@pytest.mark.parametrize("step", [None, 1], ids=["newest", "explicit"])
def test_optimizer_with_other_param_groups_raises_before_touching_the_model(saved, step):
    model = _model(1)
    opt = _trained_opt(model, groups=1)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    opt_before = {i: {k: v.clone() for k, v in s.items()} for i, s in enumerate(opt.state.values())}
    with flashckpt.Checkpointer(saved) as ck:
        with pytest.raises(StateMismatchError, match=r"'optim'.*param group") as exc:
            ck.restore({"model": model, "optim": opt}, step=step)
    assert "2 param groups" in str(exc.value) and "1" in str(exc.value)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k  # bitwise untouched
    for i, s in enumerate(opt.state.values()):
        for k, v in s.items():
            assert torch.equal(v, opt_before[i][k]), (i, k)
    assert len(opt.param_groups) == 1


def test_a_stateful_whose_load_fails_becomes_one_flashckpt_error(saved):
    class Picky:
        def state_dict(self):
            return {"x": torch.zeros(3)}

        def load_state_dict(self, sd):
            raise ValueError("not my kind of state")

    with flashckpt.Checkpointer(saved.parent / "ck2") as ck:
        ck.save(1, {"picky": Picky(), "w": torch.ones(2)})
        w = torch.zeros(2)
        with pytest.raises(StateMismatchError, match=r"'picky'.*not my kind of state"):
            ck.restore({"picky": Picky(), "w": w})
