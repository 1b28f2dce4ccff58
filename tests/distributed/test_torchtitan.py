"""torchtitan both ways (issue 31), on 1 and 2 gloo ranks with FSDP2: a flashckpt step saved by
the drop-in manager (examples/torchtitan_checkpointer.py) exports to the DCP layout
torchtitan's checkpoint manager loads, and a checkpoint in that layout imports and resumes
through the manager. torchtitan's side is titan_state.py (its manager's exact layout)."""

from __future__ import annotations

import logging
import pickle
from pathlib import Path

import pytest
import torch
from titan_state import (
    AUX,
    State,
    assert_same,
    flash_load,
    flash_save,
    titan_load,
    titan_save,
)

import flashckpt
from flashckpt.cli import main
from flashckpt.errors import FlashCkptError, StateMismatchError
from flashckpt.integrations.dcp_metadata import read_metadata
from flashckpt.integrations.interop import import_checkpoint

pytestmark = pytest.mark.dist


@pytest.mark.parametrize("world", [1, 2])
def test_flashckpt_step_exports_to_what_torchtitan_loads(ranks, tmp_path: Path, world) -> None:
    saved = ranks.ok(ranks(flash_save, world, tmp_path / "s", str(tmp_path), timeout_s=120))
    root = tmp_path / "checkpoint"
    out = tmp_path / "titan" / "step-3"
    # the entries are torchtitan's names, so the torchtitan layout is picked without a flag
    assert main(["export", str(root), str(out), "--format", "dcp"]) == 0
    keys = set(read_metadata(out).state_dict_metadata)
    assert "tok_embeddings.weight" in keys and "layers.0.attention.wq.weight" in keys
    assert not any(k.startswith("model.") for k in keys)  # issue 31: it was under "model."
    assert "optimizer.state.layers.0.w2.weight.exp_avg" in keys
    assert "optimizer.param_groups.output.weight.lr" in keys
    assert {"lr_scheduler.last_epoch", "train_state.step", "train_state.ntokens_seen"} <= keys
    assert {f"dataloader.dp_rank_{r}" for r in range(world)} <= keys  # every rank's position
    loaded = ranks.ok(ranks(titan_load, world, tmp_path / "l", str(out), timeout_s=120))
    for got, want in zip(loaded, saved):
        assert_same(got, want)


def test_layout_flag_and_its_misuse(ranks, tmp_path: Path, capsys) -> None:
    ranks.ok(ranks(flash_save, 1, tmp_path / "s", str(tmp_path), timeout_s=120))
    root = tmp_path / "checkpoint"
    out = tmp_path / "titan"
    assert main(["export", str(root), str(out), "--format", "dcp", "--layout", "torchtitan"]) == 0
    assert "tok_embeddings.weight" in read_metadata(out).state_dict_metadata
    nested = tmp_path / "nested"
    assert main(["export", str(root), str(nested), "--format", "dcp", "--layout", "dcp"]) == 0
    assert "model.tok_embeddings.weight" in read_metadata(nested).state_dict_metadata
    capsys.readouterr()
    bad = ["export", str(root), str(tmp_path / "x.st"), "--layout", "torchtitan"]
    assert main(bad) == 2
    assert "--layout applies to --format dcp" in capsys.readouterr().err


@pytest.mark.parametrize(("save_world", "load_world"), [(2, 2), (2, 1)])
def test_torchtitan_checkpoint_imports_and_resumes(
    ranks, tmp_path: Path, caplog, save_world: int, load_world: int
) -> None:
    src = tmp_path / "titan" / "step-3"
    saved = ranks.ok(ranks(titan_save, save_world, tmp_path / "s", str(src), timeout_s=120))
    root = tmp_path / "checkpoint"
    with caplog.at_level(logging.WARNING, logger="flashckpt"):
        state = import_checkpoint(src, root, step=3, format="dcp")
    assert sorted(state) == sorted(["model", *AUX])  # issue 31: the model came as 4 entries
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]  # was 432 lines
    groups = [k for k in state["optimizer"] if k.startswith("param_groups.")]
    assert "param_groups.layers.1.w2.weight.lr" in groups  # issue 31: param groups were lost
    assert state["train_state"] == {"step": 3, "ntokens_seen": 96}
    loaded = ranks.ok(ranks(flash_load, load_world, tmp_path / "l", str(tmp_path), timeout_s=120))
    if load_world == save_world:
        for got, want in zip(loaded, saved):
            assert_same(got, want)
    else:  # one rank: the full model and optimizer, rank 0's data position
        assert_same(loaded[0], saved[0])


def test_the_import_restores_into_a_plain_model_and_optimizer(ranks, tmp_path: Path) -> None:
    src = tmp_path / "titan"
    saved = ranks.ok(ranks(titan_save, 1, tmp_path / "s", str(src), timeout_s=120))[0]
    root = tmp_path / "ck"
    import_checkpoint(src, root, step=3, format="dcp")
    fresh = State(0, 1, seed=9, fsdp=False)
    opt = torch.optim.AdamW(fresh.model.parameters(), lr=1.0)
    with flashckpt.Checkpointer(root) as ck:
        assert ck.restore({"model": fresh.model, "optimizer": opt}, strict=False) == 3
    for k, v in saved["model"].items():
        assert torch.equal(fresh.model.state_dict()[k], v), k
    names = dict(zip(range(100), [n for n, _ in fresh.model.named_parameters()]))
    for pid, per in opt.state_dict()["state"].items():
        for leaf, t in per.items():
            assert torch.equal(t, saved["optim"][f"state.{names[pid]}.{leaf}"]), (pid, leaf)
    assert opt.param_groups[0]["lr"] == saved["lr"] == 0.02  # not the live 1.0
    assert tuple(opt.param_groups[0]["betas"]) == (0.8, 0.9)


def test_a_remaining_mismatch_is_one_error_naming_the_key(ranks, tmp_path: Path) -> None:
    src = tmp_path / "titan"
    ranks.ok(ranks(titan_save, 1, tmp_path / "s", str(src), timeout_s=120))
    root = tmp_path / "ck"
    import_checkpoint(src, root, step=3, format="dcp")

    class NewTrainState:  # a trainer whose state grew a key the checkpoint lacks
        def state_dict(self) -> dict[str, object]:
            return {"step": 0, "ntokens_seen": 0, "epoch": 0}

        def load_state_dict(self, state: dict[str, object]) -> None:
            self.epoch = state["epoch"]

    with flashckpt.Checkpointer(root) as ck, pytest.raises(StateMismatchError) as err:
        ck.restore({"train_state": NewTrainState()})
    assert "'epoch'" in str(err.value) and err.value.keys == ["train_state/epoch"]
    other = torch.nn.Linear(3, 3)  # an optimizer over parameters the checkpoint never saw
    with flashckpt.Checkpointer(root) as ck, pytest.raises(FlashCkptError, match="optimizer key"):
        ck.restore(
            {"model": other, "optimizer": torch.optim.AdamW(other.parameters())}, strict=False
        )


def test_bytes_travel_as_base64_and_never_unpickle(tmp_path: Path) -> None:
    from flashckpt.integrations.torchtitan import BytesState, bytes_to_json, json_to_bytes

    blob = pickle.dumps({"pos": 7})
    assert json_to_bytes(bytes_to_json({"dp_rank_0": blob, "n": [b"x"]})) == {
        "dp_rank_0": blob,
        "n": [b"x"],
    }

    class Loader:
        def __init__(self) -> None:
            self.state: dict[str, object] = {"dp_rank_0": blob, "world_size": 1}

        def state_dict(self) -> dict[str, object]:
            return self.state

        def load_state_dict(self, state: dict[str, object]) -> None:
            self.state = state

    with flashckpt.Checkpointer(tmp_path / "ck") as ck:
        ck.save(1, {"dataloader": BytesState(Loader())})
        back = Loader()
        back.state = {}
        assert ck.restore({"dataloader": BytesState(back)}) == 1
    assert back.state == {"dp_rank_0": blob, "world_size": 1}


class _Planted:
    """A value whose unpickling would create a file (what a hostile checkpoint plants)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[object, tuple[str, str]]:
        return (open, (self.path, "w"))


def test_value_blobs_are_read_without_running_code(tmp_path: Path, caplog) -> None:
    import torch.distributed.checkpoint as dcp

    planted = tmp_path / "planted"
    src = tmp_path / "titan"
    state = {
        "tok_embeddings.weight": torch.ones(4, 2),
        "optimizer": {"state.tok_embeddings.weight.exp_avg": torch.zeros(4, 2)},
        "train_state": {"step": 5, "evil": _Planted(str(planted))},
    }
    dcp.save(state, checkpoint_id=str(src), no_dist=True)
    with caplog.at_level(logging.WARNING, logger="flashckpt"):
        got = import_checkpoint(src, tmp_path / "ck", step=5, format="dcp")
    assert not planted.exists()  # weights_only=True refused it; nothing ran
    assert got["train_state"] == {"step": 5}
    lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(lines) == 1 and "train_state.evil" in lines[0], lines


def test_a_name_keyed_optimizer_restores_into_torchtitans_container(tmp_path: Path) -> None:
    """A step whose optimizer was saved keyed by name (OptimizerByName, or a DCP import made
    before issue 31) restores into torchtitan's flat-form OptimizersContainer. Issue 31: this
    crashed inside flashckpt with a raw ``KeyError: 'param_groups'`` (by_id read the
    container's flat state_dict as torch.optim's)."""
    from flashckpt.integrations.dcp_layout import OptimizerByName

    src = State(0, 1, seed=0, fsdp=False)
    src.train(2)
    inner = src.optimizers.optimizers[0]
    with flashckpt.Checkpointer(tmp_path / "ck") as ck:
        ck.save(2, {"model": src.model, "optimizer": OptimizerByName(src.model, inner)})
    want = src.snapshot()
    dst = State(0, 1, seed=9, fsdp=False)
    with flashckpt.Checkpointer(tmp_path / "ck") as ck:
        assert ck.restore({"model": dst.model, "optimizer": dst.optimizers}) == 2
    got = dst.snapshot()
    assert sorted(got["optim"]) == sorted(want["optim"])
    for k, v in want["optim"].items():
        g = got["optim"][k]
        assert (
            torch.equal(g, v)
            if isinstance(v, torch.Tensor)
            else tuple(g) == tuple(v)
            if isinstance(v, (list, tuple))
            else g == v
        ), k
