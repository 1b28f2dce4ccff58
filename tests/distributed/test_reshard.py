"""FSDP2 + AdamW saved on N ranks loads on M ranks (and in a plain process), bit for bit."""

from __future__ import annotations

import math
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from flashckpt import Checkpointer
from flashckpt.cli import main as cli_main
from flashckpt.state.rng import RNG
from flashckpt.store.files.backend import LocalBackend
from flashckpt.store.store import CheckpointStore

pytestmark = pytest.mark.dist


class Net(nn.Module):
    """Uneven sizes on purpose: 13 rows over 4 ranks is 4/4/4/1, over 3 is 5/5/3."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(10, 13)
        self.b = nn.Linear(13, 256)
        self.c = nn.Linear(256, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.relu(self.b(torch.relu(self.a(x)))))


def build(world: int | None, seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    net = Net()
    if world is not None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for layer in (net.a, net.b, net.c):
            fully_shard(layer, mesh=mesh)
        fully_shard(net, mesh=mesh)
    return net, torch.optim.AdamW(net.parameters(), lr=1e-2)


def train(net: nn.Module, opt: torch.optim.Optimizer, steps: int) -> None:
    g = torch.Generator().manual_seed(7)
    for _ in range(steps):
        loss = net(torch.randn(8, 10, generator=g)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()


def full(value: Any) -> Any:
    """Full tensors of a (possibly sharded) state dict; a collective on DTensors."""
    if isinstance(value, dict):
        return {k: full(v) for k, v in value.items()}
    if isinstance(value, list):
        return [full(v) for v in value]
    if hasattr(value, "full_tensor"):
        return value.full_tensor().clone()
    return value.clone() if isinstance(value, torch.Tensor) else value


def snapshot(net: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    return {"model": full(net.state_dict()), "optim": full(opt.state_dict()["state"])}


def save_job(rank: int, world: int, root: str) -> dict[str, Any]:
    net, opt = build(world, seed=0)
    train(net, opt, 2)
    torch.manual_seed(1000 + rank)  # per-rank RNG differs
    state = {"model": net, "optim": opt, "rng": RNG(), "data": {"pos": 100 + rank}}
    with Checkpointer(root, dist_timeout_s=30, chunk_size="4KiB", fsync=False) as ckpt:
        ckpt.save(2, state)
    return {**snapshot(net, opt), "rng": torch.get_rng_state()}


def load_job(rank: int, world: int, root: str, sharded: bool = True) -> dict[str, Any]:
    net, opt = build(world if sharded else None, seed=5)
    state = {"model": net, "optim": opt, "rng": RNG(), "data": {"pos": -1}}
    with Checkpointer(root, dist_timeout_s=30, fsync=False) as ckpt:
        backend = ckpt.store.backend
        read_bytes = [0]
        plain_read, plain_into = backend.read, backend.read_into

        def read(path: str) -> bytes:
            data = plain_read(path)
            read_bytes[0] += len(data) if path.startswith("chunks/") else 0
            return data

        def read_into(path: str, out: Any, **kw: Any) -> int:
            n = plain_into(path, out, **kw)
            read_bytes[0] += n if path.startswith("chunks/") else 0
            return n

        backend.read, backend.read_into = read, read_into  # type: ignore[method-assign]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            step = ckpt.restore(state)
    out = snapshot(net, opt)
    rng = torch.get_rng_state()
    out.update(step=step, rng=rng, pos=state["data"]["pos"], read=read_bytes[0])
    out["warned"] = [str(w.message) for w in caught if "per-rank state" in str(w.message)]
    return out


def assert_same(got: dict[str, Any], want: dict[str, Any]) -> None:
    for part in ("model", "optim"):
        flat_got, flat_want = _flat(got[part]), _flat(want[part])
        assert flat_got.keys() == flat_want.keys(), part
        for k, v in flat_want.items():
            assert torch.equal(flat_got[k], v), f"{part}/{k} differs"


def _flat(d: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(d, dict):
        out: dict[str, Any] = {}
        for k, v in d.items():
            out.update(_flat(v, f"{prefix}{k}/"))
        return out
    return {prefix: d}


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory, ranks: Any) -> dict[int, tuple[Path, Any]]:
    """FSDP2 checkpoints saved on 4 and on 2 ranks, with what each rank held."""
    out = {}
    for world in (4, 2):
        root = tmp_path_factory.mktemp(f"fsdp{world}")
        out[world] = (root / "ckpt", ranks.ok(ranks(save_job, world, root, str(root / "ckpt"))))
    return out


@pytest.mark.parametrize(("src", "dst"), [(4, 2), (4, 3), (2, 3)])
def test_fsdp_reshard(saved: Any, ranks: Any, tmp_path: Path, src: int, dst: int) -> None:
    root, before = saved[src]
    results = ranks.ok(ranks(load_job, dst, tmp_path, str(root)))
    total = CheckpointStore(LocalBackend(root)).load_manifest(2).total_bytes
    for r, got in enumerate(results):
        assert got["step"] == 2
        assert_same(got, before[0])
        old = r if r < src else 0  # ranks the saving job did not have get rank 0's state
        assert got["pos"] == 100 + old
        assert torch.equal(got["rng"], before[old]["rng"])
        assert bool(got["warned"]) == (r >= src)
        # chunks (4 KiB here) holding no byte of this rank's shards are never read
        assert 0 < got["read"] < 0.8 * total, f"rank {r} read {got['read']} of {total} bytes"


@pytest.mark.parametrize("src", [4, 2])
def test_sharded_loads_in_plain_process(saved: Any, src: int) -> None:
    root, before = saved[src]
    got = load_job(0, 1, str(root), sharded=False)
    assert got["step"] == 2
    assert_same(got, before[0])
    assert got["pos"] == 100
    assert torch.equal(got["rng"], before[0]["rng"])


def test_manifest_records_shards(saved: Any) -> None:
    root, _ = saved[4]
    m = CheckpointStore(LocalBackend(root)).load_manifest(2)
    assert m.world_size == 4
    w = m.tensors["model/a.weight"]
    assert w.global_shape == (13, 10)
    assert sorted((s.rank, s.offset, s.shape) for s in w.shards) == [
        (0, (0, 0), (4, 10)),
        (1, (4, 0), (4, 10)),
        (2, (8, 0), (4, 10)),
        (3, (12, 0), (1, 10)),
    ]
    assert sorted(m.rank_trees) == ["0", "1", "2", "3"]
    assert m.rank_trees["3"]["data"] == {"pos": 103}
    assert {f"rng/torch@rank{r}" for r in range(4)} <= set(m.tensors)
    assert not CheckpointStore(LocalBackend(root)).part_names()  # parts removed after publish


def plain_to_fsdp_job(rank: int, world: int, root: str) -> dict[str, Any]:
    return load_job(rank, world, root)


def test_plain_checkpoint_loads_on_two_ranks(ranks: Any, tmp_path: Path) -> None:
    net, opt = build(None, seed=0)
    train(net, opt, 2)
    torch.manual_seed(77)
    with Checkpointer(tmp_path / "ckpt") as ckpt:
        ckpt.save(2, {"model": net, "optim": opt, "rng": RNG(), "data": {"pos": 100}})
    want = {**snapshot(net, opt), "rng": torch.get_rng_state()}
    results = ranks.ok(ranks(plain_to_fsdp_job, 2, tmp_path, str(tmp_path / "ckpt")))
    for r, got in enumerate(results):
        assert got["step"] == 2
        assert_same(got, want)
        assert got["pos"] == 100
        assert torch.equal(got["rng"], want["rng"])
        assert bool(got["warned"]) == (r >= 1)


def test_export_merges_shards(saved: Any, tmp_path: Path) -> None:
    root, before = saved[4]
    out = tmp_path / "full.pt"
    assert cli_main(["export", str(root), str(out), "--format", "torch", "--prefix", "model"]) == 0
    exported = torch.load(out, weights_only=True)
    want = before[0]["model"]
    assert exported.keys() == want.keys()
    for k, v in want.items():
        assert torch.equal(exported[k], v), k
    assert math.prod(exported["a.weight"].shape) == 130
