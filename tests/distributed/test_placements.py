"""DTensor placements on 4 gloo ranks: Shard, Replicate, HSDP (Replicate x Shard), a 2D grid
and FSDP2+TP's strided rows are saved as exact boxes, merge back bit for bit, reshard to 1, 2
and 3 ranks and export; Partial and non-box strided shards are refused before anything is
written, and the next save works."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from flashckpt import Checkpointer
from flashckpt.cli import main as cli_main
from flashckpt.errors import DistributedError
from flashckpt.store.files.backend import LocalBackend
from flashckpt.store.store import CheckpointStore

pytestmark = pytest.mark.dist

SHAPES = {"row": (10, 3), "rep": (5,), "hsdp": (7, 5), "strided": (8, 4), "grid": (6, 6)}


def fulls() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {k: torch.randn(*s, generator=g) for k, s in SHAPES.items()}


def as_module(tensors: dict[str, torch.Tensor]) -> nn.Module:
    m = nn.Module()
    for k, t in tensors.items():
        m.register_parameter(k, nn.Parameter(t, requires_grad=False))
    return m


def strided_rows(full: torch.Tensor, mesh: Any, coord: list[int]) -> Any:
    """FSDP2 over TP: rows cut by tp (mesh dim 1) first, then by dp (mesh dim 0)."""
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    dp, tp = coord
    quarter = full.shape[0] // 4
    start = (tp * 2 + dp) * quarter
    local = full[start : start + quarter].clone()
    placements = [_StridedShard(0, split_factor=2), Shard(0)]
    return DTensor.from_local(local, mesh, placements, shape=full.shape, stride=full.stride())


def sharded(world: int) -> tuple[dict[str, Any], Any, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh1 = init_device_mesh("cpu", (world,))
    mesh2 = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    f = fulls()
    out = {
        "row": distribute_tensor(f["row"], mesh1, [Shard(0)]),
        "rep": distribute_tensor(f["rep"], mesh1, [Replicate()]),
        "hsdp": distribute_tensor(f["hsdp"], mesh2, [Replicate(), Shard(0)]),
        "strided": strided_rows(f["strided"], mesh2, mesh2.get_coordinate()),
        "grid": distribute_tensor(f["grid"], mesh2, [Shard(0), Shard(1)]),
    }
    return out, mesh1, mesh2


def refused(ckpt: Checkpointer, step: int, tensor: Any) -> tuple[str, str, list[int]]:
    try:
        ckpt.save(step, {"model": as_module({"x": tensor})})
    except DistributedError as exc:
        return str(exc), exc.phase, exc.ranks
    return "", "", []


def save_job(rank: int, world: int, root: str) -> dict[str, Any]:
    from torch.distributed.tensor import DTensor, Partial
    from torch.distributed.tensor.placement_types import _StridedShard

    tensors, mesh1, _ = sharded(world)
    strided_ok = tensors["strided"].full_tensor()
    with Checkpointer(root, fsync=False, dist_timeout_s=20) as ckpt:
        ckpt.save(1, {"model": as_module(tensors)})
        partial = DTensor.from_local(torch.ones(3, 3), mesh1, [Partial()])
        lone = DTensor.from_local(
            torch.ones(2, 4), mesh1, [_StridedShard(0, split_factor=2)], shape=(8, 4), stride=(4, 1)
        )
        errors = {"partial": refused(ckpt, 2, partial), "strided": refused(ckpt, 3, lone)}
        ckpt.save(4, {"model": as_module(tensors)})  # the next save works
    return {"errors": errors, "strided_full": strided_ok, "steps": ckpt.steps()}


def load_job(rank: int, world: int, root: str) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    target = {k: distribute_tensor(torch.zeros(*s), mesh, [Shard(0)]) for k, s in SHAPES.items()}
    m = as_module(target)
    with Checkpointer(root, fsync=False, dist_timeout_s=20) as ckpt:
        step = ckpt.restore({"model": m})
    return {"step": step, "full": {k: p.full_tensor() for k, p in m.named_parameters()}}


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory, ranks: Any) -> tuple[Path, list[Any]]:
    tmp = tmp_path_factory.mktemp("placements")
    return tmp / "ckpt", ranks.ok(ranks(save_job, 4, tmp, str(tmp / "ckpt")))


def test_strided_fsdp_tp_layout_is_what_dtensor_holds(saved: Any) -> None:
    _, results = saved
    for r in results:
        assert torch.equal(r["strided_full"], fulls()["strided"])


def test_partial_is_refused_before_anything_is_written(saved: Any) -> None:
    """A Partial DTensor was saved as rank 0's summand."""
    root, results = saved
    errors = [r["errors"]["partial"] for r in results]
    assert all(e == errors[0] for e in errors)
    message, phase, failed = errors[0]
    assert phase == "plan" and failed == [0, 1, 2, 3]
    assert "Partial" in message and "Reduce it before saving" in message
    assert CheckpointStore(LocalBackend(root)).steps() == [1, 4]


def test_strided_shard_that_is_not_a_box_is_refused(saved: Any) -> None:
    """A standalone _StridedShard was saved at its first offset as if contiguous."""
    _, results = saved
    errors = [r["errors"]["strided"] for r in results]
    assert all(e == errors[0] for e in errors)
    message, phase, failed = errors[0]
    assert phase == "plan" and failed == [0, 1, 2, 3] and "not one box" in message


def test_manifest_records_exact_boxes(saved: Any) -> None:
    root, _ = saved
    m = CheckpointStore(LocalBackend(root)).load_manifest(4)
    boxes = {k: sorted((s.offset, s.shape) for s in m.tensors[f"model/{k}"].shards) for k in SHAPES}
    assert boxes["strided"] == [((r * 2, 0), (2, 4)) for r in range(4)]
    assert boxes["rep"] == [((0,), (5,))]  # written once
    assert boxes["hsdp"] == [((0, 0), (4, 5)), ((4, 0), (3, 5))]  # once per shard box
    assert len(boxes["grid"]) == 4 and len(boxes["row"]) == 4


@pytest.mark.parametrize("world", [2, 3])
def test_reshards_to_other_world_sizes(saved: Any, ranks: Any, tmp_path: Path, world: int) -> None:
    root, _ = saved
    want = fulls()
    for r in ranks.ok(ranks(load_job, world, tmp_path, str(root))):
        assert r["step"] == 4
        for k, v in want.items():
            assert torch.equal(r["full"][k], v), k


def test_loads_in_one_plain_process(saved: Any) -> None:
    root, _ = saved
    m = as_module({k: torch.zeros(*s) for k, s in SHAPES.items()})
    with Checkpointer(root, fsync=False) as ckpt:
        assert ckpt.restore({"model": m}) == 4
    for k, v in fulls().items():
        assert torch.equal(getattr(m, k), v), k


def test_export_merges_every_layout(saved: Any, tmp_path: Path) -> None:
    root, _ = saved
    out = tmp_path / "full.pt"
    assert cli_main(["export", str(root), str(out), "--format", "torch", "--prefix", "model"]) == 0
    exported = torch.load(out, weights_only=True)
    for k, v in fulls().items():
        assert torch.equal(exported[k], v), k
