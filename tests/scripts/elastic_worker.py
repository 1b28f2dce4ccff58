"""A torchrun job that torchrun restarts in place: ``elastic_worker.py ROOT SHM OUT STEPS KILL``.

Trains a tiny model on every rank (replicated parameters, averaged gradients), saving every step
to a memory tier and the root. In torchrun's first attempt the last rank SIGKILLs itself right
after step KILL was saved; torchrun (``--max-restarts``) starts a new attempt, which resumes from
the memory tier. Each rank writes its restored step, the attempt number and its final parameters
to ``OUT.<rank>.json``. ``build``/``train_step`` are imported by the test for the reference run.
"""

import json
import os
import signal
import sys

import torch
import torch.distributed as dist

import flashckpt
from flashckpt.distributed.group.elastic import init_process_group, restart_count


def build() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int, world: int) -> None:
    """One step; every rank sees the same batch, so averaged gradients equal one rank's."""
    x = torch.randn(32, 8, generator=torch.Generator().manual_seed(step))
    loss = model(x).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    if world > 1:
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= world
    opt.step()


def params(model: torch.nn.Module) -> list[list[float]]:
    return [p.detach().flatten().tolist() for p in model.parameters()]


def main(root: str, shm: str, out: str, steps: int, kill: int) -> None:
    torch.set_num_threads(1)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        init_process_group("gloo")
    rank = int(os.environ.get("RANK", "0"))
    model, opt = build()
    state = {"model": model, "optim": opt}
    ckpt = flashckpt.Checkpointer(root, memory_tier=shm, keep_memory=2, dist_timeout_s=60)
    start = ckpt.restore(state) or 0
    for step in range(start + 1, steps + 1):
        train_step(model, opt, step, world)
        ckpt.save(step, state)
        if step == kill and restart_count() == 0 and rank == world - 1:
            os.kill(os.getpid(), signal.SIGKILL)
    ckpt.close()
    with open(f"{out}.{rank}.json", "w") as f:
        json.dump({"start": start, "attempt": restart_count(), "params": params(model)}, f)
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))
