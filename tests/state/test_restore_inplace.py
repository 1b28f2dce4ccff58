"""Restore fills the live tensors in place (state/restore.py ``_target``): a model's parameters
keep their storage, stay leaf Parameters that require grad, and the optimizer's references to
them still hold. A target whose dtype differs from the checkpoint's is loaded into a new tensor
and copied (converted) by load_state_dict instead."""

from __future__ import annotations

import torch

import flashckpt
from flashckpt.state.restore import plan_restore
from flashckpt.store.files.backend import LocalBackend
from flashckpt.store.store import CheckpointStore


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.LayerNorm(4))
    model.register_buffer("count", torch.arange(3))
    return model


def test_parameters_restore_in_place_and_stay_trainable(tmp_path) -> None:
    src = _model(0)
    with flashckpt.Checkpointer(tmp_path / "ck") as ck:
        ck.save(1, {"model": src})
    dst = _model(1)
    dst.count.zero_()
    opt = torch.optim.SGD(dst.parameters(), lr=0.1)
    ptrs = {k: v.data_ptr() for k, v in dst.state_dict().items()}
    with flashckpt.Checkpointer(tmp_path / "ck") as ck:
        assert ck.restore({"model": dst}) == 1
    for key, value in dst.state_dict().items():
        assert torch.equal(value, src.state_dict()[key]), key
        assert value.data_ptr() == ptrs[key], f"{key} was replaced, not filled in place"
    for p in dst.parameters():
        assert isinstance(p, torch.nn.Parameter) and p.is_leaf and p.requires_grad
        assert p.grad is None
    assert opt.param_groups[0]["params"][0] is dst[0].weight
    dst(torch.randn(2, 6)).sum().backward()  # still part of an autograd graph
    assert dst[0].weight.grad is not None


def test_a_target_of_another_dtype_is_loaded_apart_and_converted(tmp_path) -> None:
    src = _model(0)
    with flashckpt.Checkpointer(tmp_path / "ck") as ck:
        ck.save(1, {"model": src})
    manifest = CheckpointStore(LocalBackend(tmp_path / "ck")).load_manifest(1)
    dst = _model(1).to(torch.float64)
    plan = plan_restore({"model": dst}, manifest)
    weight = next(t for k, t in plan.targets.items() if k.endswith("0.weight"))
    assert weight.dest is None  # float32 bytes never land in a float64 tensor's storage
    buffer = next(t for k, t in plan.targets.items() if k.endswith("count"))
    assert buffer.dest is not None and buffer.dest.data_ptr() == dst.count.data_ptr()
    with flashckpt.Checkpointer(tmp_path / "ck") as ck:
        assert ck.restore({"model": dst}) == 1
    assert dst[0].weight.dtype == torch.float64
    assert torch.equal(dst[0].weight, src[0].weight.to(torch.float64))
