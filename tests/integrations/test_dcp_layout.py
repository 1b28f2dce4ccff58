"""DCP export/import in DCP's own layout, checked against torch's dcp.load / dcp.save and
get_state_dict / set_state_dict in processes without flashckpt, on 1 and 2 gloo ranks."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict

import flashckpt
from flashckpt.cli import main
from flashckpt.errors import ConfigError, StateMismatchError
from flashckpt.integrations import dcp_layout

WORKER = Path(__file__).with_name("dcp_worker.py")


def build() -> tuple[torch.nn.Module, torch.optim.Optimizer]:  # as dcp_worker.build
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(6, 5), torch.nn.BatchNorm1d(5), torch.nn.Linear(5, 3)
    )
    return model, torch.optim.AdamW(model.parameters(), lr=0.01, betas=(0.8, 0.9))


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    g = torch.Generator().manual_seed(1)
    model(torch.randn(8, 6, generator=g)).pow(2).sum().backward()
    opt.step()
    opt.zero_grad()


def flat(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, object]:
    msd, osd = get_state_dict(model, opt)
    out: dict[str, object] = {f"model.{k}": v for k, v in msd.items()}
    for fqn, per in osd["state"].items():
        out.update({f"optim.state.{fqn}.{k}": v for k, v in per.items()})
    out["lr"] = osd["param_groups"][0]["lr"]
    out["betas"] = list(osd["param_groups"][0]["betas"])
    return out


def assert_same(got: dict[str, object], want: dict[str, object]) -> None:
    assert sorted(got) == sorted(want)
    for k, v in want.items():
        if isinstance(v, torch.Tensor):
            g = got[k]
            assert isinstance(g, torch.Tensor) and g.dtype == v.dtype, k
            assert torch.equal(g, v), k
        else:
            assert got[k] == v, k


def run_worker(mode: str, ckpt: Path, out: Path, world: int) -> dict[str, object]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run(
        [sys.executable, str(WORKER), mode, str(ckpt), str(out), str(world)],
        capture_output=True,
        text=True,
        env=env,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = torch.load(out, weights_only=True)
    assert isinstance(got, dict)
    return got


def trained_root(tmp_path: Path) -> tuple[Path, dict[str, object]]:
    model, opt = build()
    train_step(model, opt)
    opt.param_groups[0]["lr"] = 0.005  # a scheduler moved it: dcp.load must bring it back
    root = tmp_path / "ckpt"
    with flashckpt.Checkpointer(root) as ck:
        ck.save(3, {"model": model, "optim": opt, "rng": flashckpt.RNG(), "epoch": 1})
    return root, flat(model, opt)


@pytest.mark.dist
@pytest.mark.parametrize("world", [pytest.param(1, marks=pytest.mark.slow), 2])  # 1: 12 s
def test_export_loads_with_dcp_users_own_state(tmp_path: Path, world: int) -> None:
    root, want = trained_root(tmp_path)
    out = tmp_path / "dcp"
    assert main(["export", str(root), str(out), "--format", "dcp"]) == 0
    got = run_worker("load", out, tmp_path / "got.pt", world)
    assert_same(got, want)  # model, FQN-keyed optimizer state and its param_groups


@pytest.mark.dist
@pytest.mark.parametrize("world", [pytest.param(1, marks=pytest.mark.slow), 2])  # 1: 12 s
def test_import_of_dcp_save_restores_model_and_optimizer(tmp_path: Path, world: int) -> None:
    src = tmp_path / "torch-dcp"
    want = run_worker("save", src, tmp_path / "want.pt", world)
    root = tmp_path / "root"
    assert main(["import", str(src), str(root), "--step", "5", "--format", "dcp"]) == 0
    model, opt = build()
    with flashckpt.Checkpointer(root) as ck:  # a plain optimizer: named through the model
        assert ck.restore({"model": model, "optim": opt}) == 5
    assert_same(flat(model, opt), want)
    state = dcp_layout.import_dcp(src, tmp_path / "root2", step=5)
    assert sorted(state) == ["model", "optim"]
    by_name_model, by_name_opt = build()
    with flashckpt.Checkpointer(tmp_path / "root2") as ck:
        target = {
            "model": by_name_model,
            "optim": dcp_layout.OptimizerByName(by_name_model, by_name_opt),
        }
        assert ck.restore(target) == 5
    assert_same(flat(by_name_model, by_name_opt), want)
    # the restored optimizer trains on exactly as the original would
    ref_model, ref_opt = build()
    train_step(ref_model, ref_opt)
    train_step(ref_model, ref_opt)
    train_step(model, opt)
    assert_same(flat(model, opt), flat(ref_model, ref_opt))


def _load_in_process(out: Path, model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    msd, osd = get_state_dict(model, opt)
    sd = {"model": msd, "optim": osd}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(sd, checkpoint_id=str(out), no_dist=True)
    from torch.distributed.checkpoint.state_dict import set_state_dict

    set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])


def test_grouped_optimizer_needs_names_and_gets_them_right(tmp_path: Path) -> None:
    model, _ = build()
    decay = [p for p in model.parameters() if p.dim() >= 2]  # nanoGPT's grouping
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay}, {"params": no_decay, "weight_decay": 0.0}])
    train_step(model, opt)
    root = tmp_path / "ckpt"
    with flashckpt.Checkpointer(root) as ck:
        ck.save(1, {"model": model, "optim": opt})
    with pytest.raises(ConfigError, match="param_fqns"):
        dcp_layout.export_dcp(root, tmp_path / "guess")
    out = tmp_path / "named"
    dcp_layout.export_dcp(root, out, param_fqns=dcp_layout.param_fqns(model, opt))
    fresh, fresh_opt = build()
    fresh_opt = torch.optim.AdamW(
        [
            {"params": [p for p in fresh.parameters() if p.dim() >= 2]},
            {"params": [p for p in fresh.parameters() if p.dim() < 2], "weight_decay": 0.0},
        ]
    )
    _load_in_process(out, fresh, fresh_opt)
    assert_same(flat(fresh, fresh_opt), flat(model, opt))


def test_optimizer_saved_by_name_exports_without_guessing(tmp_path: Path) -> None:
    model, _ = build()
    opt = torch.optim.AdamW([{"params": list(model.parameters())[::-1]}])  # no model order
    train_step(model, opt)
    root = tmp_path / "ckpt"
    with flashckpt.Checkpointer(root) as ck:
        ck.save(1, {"model": model, "optim": dcp_layout.OptimizerByName(model, opt)})
    out = tmp_path / "dcp"
    dcp_layout.export_dcp(root, out)
    fresh, _ = build()
    fresh_opt = torch.optim.AdamW([{"params": list(fresh.parameters())[::-1]}])
    _load_in_process(out, fresh, fresh_opt)
    assert_same(flat(fresh, fresh_opt), flat(model, opt))


def test_prefix_model_keeps_the_model_only_form(tmp_path: Path) -> None:
    root, want = trained_root(tmp_path)
    out = tmp_path / "model-only"
    assert main(["export", str(root), str(out), "--format", "dcp", "--prefix", "model"]) == 0
    model, _ = build()
    sd = {k: torch.zeros_like(v) for k, v in model.state_dict().items()}
    dcp.load(sd, checkpoint_id=str(out), no_dist=True)
    assert_same(
        {f"model.{k}": v for k, v in sd.items()},
        {k: v for k, v in want.items() if k.startswith("model.")},
    )


def test_name_keyed_optimizer_state_restores_into_a_plain_optimizer(tmp_path: Path) -> None:
    """State saved as OptimizerByName (FQN-keyed, with its param_groups) restores into a plain
    optimizer, hyperparameters included; a parameter the checkpoint does not know is refused
    before anything is read."""
    model, opt = build()
    train_step(model, opt)
    opt.param_groups[0]["lr"] = 0.005
    with flashckpt.Checkpointer(tmp_path) as ck:
        ck.save(1, {"model": model, "optim": dcp_layout.OptimizerByName(model, opt)})
    model2, opt2 = build()
    with flashckpt.Checkpointer(tmp_path) as ck:
        assert ck.restore({"model": model2, "optim": opt2}) == 1
    assert_same(flat(model2, opt2), flat(model, opt))
    assert opt2.param_groups[0]["lr"] == 0.005

    other = torch.nn.Linear(6, 5)  # an optimizer over a module that is not in the state
    with flashckpt.Checkpointer(tmp_path) as ck, pytest.raises(StateMismatchError, match="model"):
        ck.restore({"model": model2, "optim": torch.optim.AdamW(other.parameters())})
