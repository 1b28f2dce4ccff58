"""A torchtitan-shaped training state and torchtitan's checkpoint manager's DCP layout,
reproduced for the tests (torchtitan 0.3.0 itself pulls wandb, datasets and a different fsspec,
so it is not a test dependency).

What torchtitan's ``CheckpointManager`` (torchtitan/components/checkpointer/dcp.py) saves and
loads is one DCP state dict: the model's FQNs at the top level (its ``ModelWrapper`` state,
loaded back with ``set_model_state_dict(strict=False)``) beside ``optimizer`` (the
``OptimizersContainer``, an ``Optimizer`` whose state_dict is the flat FQN-keyed form
``state.<fqn>.<name>`` / ``param_groups.<fqn>.<key>``), ``lr_scheduler`` (``{"last_epoch":
n}``), ``train_state`` (the trainer: ``{"step", "ntokens_seen"}``) and ``dataloader``
(``{"dp_rank_<r>": pickled bytes, "world_size": n}``); DCP calls ``state_dict`` /
``load_state_dict`` on the Stateful values itself.
"""

from __future__ import annotations

import pickle
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
AUX = ("optimizer", "lr_scheduler", "train_state", "dataloader")
FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.attention = nn.ModuleDict({"wq": nn.Linear(dim, dim, bias=False)})
        self.feed_forward = nn.ModuleDict({"w1": nn.Linear(dim, 3 * dim, bias=False)})
        self.w2 = nn.Linear(3 * dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention["wq"](x)
        return x + self.w2(torch.relu(self.feed_forward["w1"](x)))


class Titan(nn.Module):
    """torchtitan's FQN shapes: tok_embeddings, layers.<i>..., norm, output."""

    def __init__(self, dim: int = 16, vocab: int = 32, n_layers: int = 2) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleDict({str(i): Block(dim) for i in range(n_layers)})
        self.norm = nn.RMSNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tok_embeddings(ids)
        for layer in self.layers.values():
            x = layer(x)
        return self.output(self.norm(x))


class Optimizers(torch.optim.Optimizer):
    """torchtitan's OptimizersContainer: an Optimizer over the inner ones, flat state."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.optimizers = [torch.optim.AdamW(model.parameters(), lr=0.02, betas=(0.8, 0.9))]
        params = [p for o in self.optimizers for g in o.param_groups for p in g["params"]]
        torch.optim.Optimizer.__init__(self, params, {})

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        for o in self.optimizers:
            o.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.optimizers:
            o.zero_grad(set_to_none=set_to_none)

    def _materialize(self) -> None:
        """As torchtitan's init_optim_state: a zero-gradient, zero-lr step creates the state
        tensors (exp_avg, ...) that saving reads and loading fills."""
        for o in self.optimizers:
            if o.state:
                continue
            lrs = [g["lr"] for g in o.param_groups]
            for g in o.param_groups:
                g["lr"] = 0.0
                for p in g["params"]:
                    p.grad = torch.zeros_like(p)
            o.step()
            for g, lr in zip(o.param_groups, lrs):
                g["lr"] = lr
            o.zero_grad(set_to_none=True)

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        self._materialize()
        return dict(get_optimizer_state_dict(self.model, self.optimizers, options=FLAT))

    def load_state_dict(self, state: dict[str, Any]) -> None:  # type: ignore[override]
        self._materialize()
        set_optimizer_state_dict(self.model, self.optimizers, state, options=FLAT)


class Schedulers:
    """torchtitan's LRSchedulersContainer: LambdaLR warmup, state ``{"last_epoch": n}``."""

    def __init__(self, optimizers: Optimizers) -> None:
        self.schedulers = [
            torch.optim.lr_scheduler.LambdaLR(o, lambda s: min(1.0, (s + 1) / 4))
            for o in optimizers.optimizers
        ]

    def step(self) -> None:
        for s in self.schedulers:
            s.step()

    def state_dict(self) -> dict[str, Any]:
        return {"last_epoch": self.schedulers[0].last_epoch}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for s in self.schedulers:
            s.last_epoch = state["last_epoch"]
            s._step_count = state["last_epoch"] + 1
            s._last_lr = s.get_lr()


class TrainState:
    def __init__(self) -> None:
        self.step = 0
        self.ntokens_seen = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "ntokens_seen": self.ntokens_seen}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = state["step"]
        self.ntokens_seen = state["ntokens_seen"]


class DataLoader:
    """torchtitan's ParallelAwareDataloader state: this dp rank's position, pickled."""

    def __init__(self, rank: int, world: int) -> None:
        self.rank, self.world, self.pos = rank, world, 0

    def state_dict(self) -> dict[str, Any]:
        return {f"dp_rank_{self.rank}": pickle.dumps({"pos": self.pos}), "world_size": self.world}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.pos = pickle.loads(state[f"dp_rank_{self.rank}"])["pos"]


class State:
    def __init__(self, rank: int, world: int, *, seed: int, fsdp: bool) -> None:
        torch.manual_seed(seed)
        self.model = Titan()
        if fsdp:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            mesh = init_device_mesh("cpu", (world,))
            for layer in self.model.layers.values():
                fully_shard(layer, mesh=mesh)
            fully_shard(self.model, mesh=mesh)
        self.optimizers = Optimizers(self.model)
        self.lr_schedulers = Schedulers(self.optimizers)
        self.train_state = TrainState()
        self.dataloader = DataLoader(rank, world)
        self.rank = rank

    def train(self, steps: int) -> None:
        g = torch.Generator().manual_seed(100 + self.rank)
        for _ in range(steps):
            ids = torch.randint(0, 32, (4, 8), generator=g)
            self.model(ids).float().pow(2).mean().backward()
            self.optimizers.step()
            self.optimizers.zero_grad()
            self.lr_schedulers.step()
            self.train_state.step += 1
            self.train_state.ntokens_seen += ids.numel()
            self.dataloader.pos += ids.shape[0]

    def titan_states(self) -> dict[str, Any]:
        """What the manager hands DCP: the flattened model beside the Stateful entries."""
        return {
            **self.model.state_dict(),
            "optimizer": self.optimizers,
            "lr_scheduler": self.lr_schedulers,
            "train_state": self.train_state,
            "dataloader": self.dataloader,
        }

    def titan_save(self, path: str) -> None:
        dcp.save(self.titan_states(), checkpoint_id=path)

    def titan_load(self, path: str) -> None:
        states = self.titan_states()
        dcp.load(states, checkpoint_id=path)
        model_sd = {k: v for k, v in states.items() if k not in AUX}
        set_model_state_dict(self.model, model_sd, options=StateDictOptions(strict=False))

    def manager(self, folder: Path) -> Any:
        from torchtitan_checkpointer import FlashCheckpointManager

        class Config:
            enable, interval, keep_latest_k, load_step = True, 1, 3, -1
            folder = "checkpoint"
            async_mode = "async"
            exclude_from_loading = ()

        return FlashCheckpointManager(
            Config(),
            dataloader=self.dataloader,
            model_parts=[self.model],
            optimizers=self.optimizers,
            lr_schedulers=self.lr_schedulers,
            states={"train_state": self.train_state},
            base_folder=str(folder),
        )

    def snapshot(self) -> dict[str, Any]:
        """Full tensors and values (a collective when sharded), for comparison."""

        def full(v: Any) -> Any:
            if hasattr(v, "full_tensor"):
                return v.full_tensor().clone()
            return v.clone() if isinstance(v, torch.Tensor) else v

        return {
            "model": {k: full(v) for k, v in self.model.state_dict().items()},
            "optim": {k: full(v) for k, v in self.optimizers.state_dict().items()},
            "lr": self.optimizers.optimizers[0].param_groups[0]["lr"],
            "last_epoch": self.lr_schedulers.schedulers[0].last_epoch,
            "train": self.train_state.state_dict(),
            "pos": self.dataloader.pos,
        }


def assert_same(got: dict[str, Any], want: dict[str, Any]) -> None:
    for part in ("model", "optim"):
        assert sorted(got[part]) == sorted(want[part]), part
        for k, v in want[part].items():
            g = got[part][k]
            if isinstance(v, torch.Tensor):
                assert torch.equal(g, v), f"{part} {k} differs"
            else:
                assert (list(g) if isinstance(g, tuple) else g) == (
                    list(v) if isinstance(v, tuple) else v
                ), f"{part} {k}: {g!r} != {v!r}"
    for k in ("lr", "last_epoch", "train", "pos"):
        assert got[k] == want[k], f"{k}: {got[k]!r} != {want[k]!r}"


# rank functions (run_ranks forks them; each returns its snapshot) -------------------------
def flash_save(rank: int, world: int, folder: str) -> dict[str, Any]:
    state = State(rank, world, seed=0, fsdp=world > 1)
    state.train(3)
    mgr = state.manager(Path(folder))
    mgr.save(3)
    mgr.close()
    return state.snapshot()


def flash_load(rank: int, world: int, folder: str) -> dict[str, Any]:
    state = State(rank, world, seed=9, fsdp=world > 1)
    mgr = state.manager(Path(folder))
    assert mgr.load()
    mgr.close()
    return state.snapshot()


def titan_save(rank: int, world: int, path: str) -> dict[str, Any]:
    state = State(rank, world, seed=0, fsdp=world > 1)
    state.train(3)
    state.titan_save(path)
    return state.snapshot()


def titan_load(rank: int, world: int, path: str) -> dict[str, Any]:
    state = State(rank, world, seed=9, fsdp=world > 1)
    state.titan_load(path)
    if dist.is_initialized():
        dist.barrier()
    return state.snapshot()
