"""torch.compile'd modules: saved without '_orig_mod.', restored into compiled or plain models;
mismatches that are only a prefix say so."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from flashckpt import Checkpointer, StateMismatchError
from flashckpt.state.compiled import canonical, canonical_key, prefix_hint, rekey_like


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.norm = torch.nn.LayerNorm(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(torch.relu(self.lin(x)))


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block: torch.nn.Module = Block()
        self.head = torch.nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(x))


def _trained(seed: int, *, compile_whole: bool = False, compile_block: bool = False) -> Any:
    torch.manual_seed(seed)
    net = Net()
    if compile_block:
        net.block = torch.compile(net.block, backend="eager")
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    for _ in range(2):
        loss = net(torch.randn(4, 8)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    model: torch.nn.Module = torch.compile(net, backend="eager") if compile_whole else net
    return model, opt


def _plain_sd(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {canonical_key(k): v.clone() for k, v in model.state_dict().items()}


def _saved_keys(root: Path) -> list[str]:
    (manifest,) = sorted((root / "steps").glob("*.json"))
    return sorted(json.loads(manifest.read_text())["tensors"])


@pytest.mark.parametrize(
    ("src", "dst"),
    [
        ({"compile_whole": True}, {}),
        ({}, {"compile_whole": True}),
        pytest.param({"compile_block": True}, {"compile_whole": True}, marks=pytest.mark.slow),
        pytest.param({"compile_whole": True, "compile_block": True}, {}, marks=pytest.mark.slow),
    ],
    ids=["compiled-to-plain", "plain-to-compiled", "block-to-whole", "both-to-plain"],
)
def test_compiled_and_plain_models_restore_each_other(
    tmp_path: Path, src: dict[str, bool], dst: dict[str, bool]
) -> None:
    model, opt = _trained(0, **src)
    assert any("_orig_mod." in k for k in model.state_dict()) == bool(src)
    want = _plain_sd(model)
    want_opt = opt.state_dict()["state"]
    with Checkpointer(tmp_path) as ck:
        ck.save(3, {"model": model, "optim": opt})
    assert not [k for k in _saved_keys(tmp_path) if "_orig_mod" in k]
    assert "model/block.lin.weight" in _saved_keys(tmp_path)

    model2, opt2 = _trained(1, **dst)
    with Checkpointer(tmp_path) as ck:
        assert ck.restore({"model": model2, "optim": opt2}) == 3
    got = _plain_sd(model2)
    assert sorted(got) == sorted(want)
    for k in want:
        assert torch.equal(got[k], want[k]), k
    for pid, st in want_opt.items():
        assert torch.equal(opt2.state_dict()["state"][pid]["exp_avg"], st["exp_avg"])
    out = model2(torch.randn(2, 8))  # the restored model runs (compiled: through dynamo)
    assert out.shape == (2, 2)


def test_fqn_keyed_optimizer_state_through_compiled_names(tmp_path: Path) -> None:
    """A plain-dict state keyed by the compiled model's names (FQN-keyed optimizer form, with
    FQN strings in param_groups) is saved canonical and handed back in the target's names."""
    model, _ = _trained(0, compile_whole=True)
    names = [n for n, _ in model.named_parameters()]
    assert names[0].startswith("_orig_mod.")
    optim = {
        "state": {n: {"exp_avg": torch.full((2,), float(i))} for i, n in enumerate(names)},
        "param_groups": [{"lr": 0.1, "params": list(names)}],
    }
    with Checkpointer(tmp_path) as ck:
        ck.save(1, {"optim": optim})
    assert not [k for k in _saved_keys(tmp_path) if "_orig_mod" in k]
    plain = [canonical_key(n) for n in names]
    target = {
        "optim": {
            "state": {n: {"exp_avg": torch.zeros(2)} for n in plain},
            "param_groups": [{"lr": 0.0, "params": list(plain)}],
        }
    }
    with Checkpointer(tmp_path) as ck:
        ck.restore(target)
    assert target["optim"]["param_groups"] == [{"lr": 0.1, "params": plain}]
    assert torch.equal(target["optim"]["state"][plain[2]]["exp_avg"], torch.full((2,), 2.0))


def _as_older_versions_wrote_it(root: Path) -> None:
    """Rewrite the manifest with '_orig_mod.' in every model key, as flashckpt stored a
    compiled model's state before keys were made canonical."""
    manifest = sorted((root / "steps").glob("*.json"))[0]
    doc = json.loads(manifest.read_text())
    old = lambda k: k.replace("model/", "model/_orig_mod.", 1)  # noqa: E731
    doc["tensors"] = {
        (old(k) if k.startswith("model/") else k): ({**e, "key": old(k)} if "key" in e else e)
        for k, e in doc["tensors"].items()
    }
    doc["tree"]["model"] = {
        f"_orig_mod.{k}": {"__t__": old(v["__t__"])} for k, v in doc["tree"]["model"].items()
    }
    manifest.write_text(json.dumps(doc))


@pytest.mark.parametrize("compiled_target", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_old_checkpoint_with_orig_mod_keys_still_restores(
    tmp_path: Path, compiled_target: bool
) -> None:
    model, _ = _trained(0, compile_whole=True)
    want = _plain_sd(model)
    with Checkpointer(tmp_path) as ck:
        ck.save(1, {"model": model})
    _as_older_versions_wrote_it(tmp_path)
    assert all("_orig_mod." in k for k in _saved_keys(tmp_path))
    target, _ = _trained(1, compile_whole=compiled_target)
    with Checkpointer(tmp_path) as ck:
        assert ck.restore({"model": target}) == 1
    got = _plain_sd(target)
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_ddp_prefix_mismatch_names_the_prefix_and_the_fix(tmp_path: Path) -> None:
    model, _ = _trained(0)
    with Checkpointer(tmp_path) as ck:
        ck.save(1, {"model": {f"module.{k}": v for k, v in model.state_dict().items()}})
    with Checkpointer(tmp_path) as ck, pytest.raises(StateMismatchError) as err:
        ck.restore({"model": Net()})
    msg = str(err.value)
    assert "'module.'" in msg and "checkpoint's keys" in msg
    assert "ddp_model.module" in msg


def test_wrapper_prefix_mismatch_hint_on_the_model_side(tmp_path: Path) -> None:
    class Wrapper(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = Net()

    with Checkpointer(tmp_path) as ck:
        ck.save(1, {"model": Net()})
    with Checkpointer(tmp_path) as ck, pytest.raises(StateMismatchError) as err:
        ck.restore({"model": Wrapper()})
    assert "prefix 'inner.' that the model's keys have" in str(err.value)


def test_unrelated_mismatch_has_no_prefix_hint() -> None:
    assert prefix_hint(["m/a.weight"], ["m/b.weight"]) is None
    assert prefix_hint(["m/a", "m/b"], ["m/x.a"]) is None
    assert prefix_hint(["m/a", "m/b"], ["m/x.a", "m/y.b"]) is None
    assert prefix_hint(["m/a", "m/b"], ["m/x.a", "m/x.b"]) is not None


def test_canonical_helpers_leave_unrelated_names_alone() -> None:
    assert canonical_key("x_orig_mod.w") == "x_orig_mod.w"
    assert canonical_key("_orig_mod._orig_mod.a._orig_mod.b") == "a.b"
    assert canonical_key("model/_orig_mod.w") == "model/w"
    plain = {"a": torch.zeros(1), "b": [1, "x"]}
    assert canonical(plain) is plain  # nothing to do: not rebuilt
    assert rekey_like({"w": 1, "z": 2}, {"_orig_mod.w": 0}) == {"_orig_mod.w": 1, "z": 2}


def test_keys_equal_once_canonical_are_refused(tmp_path: Path) -> None:
    from flashckpt.errors import UnsupportedStateError

    with Checkpointer(tmp_path) as ck, pytest.raises(UnsupportedStateError, match="_orig_mod"):
        ck.save(1, {"model": {"w": torch.zeros(1), "_orig_mod.w": torch.ones(1)}})


def test_canonical_descends_into_what_only_looks_like_a_tensor_reference() -> None:
    """canonical skips a saved tree's ``{"__t__": key}`` (its one key is no state key); a state
    whose dict is keyed "__t__" but holds a container is still renamed inside."""
    ref = {"__t__": "model/_orig_mod.w"}
    tree = {"_orig_mod.w": ref}
    out = canonical(tree)
    assert out == {"w": ref} and out["w"] is ref  # the key renamed, the reference kept
    looks = {"__t__": {"_orig_mod.w": 1}}
    assert canonical(looks) == {"__t__": {"w": 1}}
    nested = {"a": [{"_orig_mod.b": 2}], "c": {"__np__": ["_orig_mod.x"]}}
    assert canonical(nested) == {"a": [{"b": 2}], "c": {"__np__": ["x"]}}


def test_rekey_like_renames_nested_containers_only_where_the_target_is_compiled() -> None:
    decoded = {"w": torch.zeros(1), "sub": {"v": 1}, "lst": [{"u": 2}]}
    target = {"_orig_mod.w": 0, "sub": {"_orig_mod.v": 0}, "lst": [{"_orig_mod.u": 0}]}
    out = rekey_like(decoded, target)
    assert set(out) == {"_orig_mod.w", "sub", "lst"}
    assert out["sub"] == {"_orig_mod.v": 1} and out["lst"] == [{"_orig_mod.u": 2}]
    assert out["_orig_mod.w"] is decoded["w"]  # a leaf is handed over, never copied
