"""The demo's training process: ``python -m flashckpt.demo.train CONFIG.json``.

Trains the demo GPT with async incremental checkpoints to a memory tier and a disk tier,
resuming from the newest checkpoint when there is one. Appends one JSON line per step to the
losses file so the parent can watch (and kill) it. This is the three-line integration:
``Checkpointer(...)``, ``restore``, ``should_save``/``save``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader

import flashckpt
from flashckpt.demo.data import CharDataset, CharTokenizer, load_corpus
from flashckpt.demo.model import GPT, GPTConfig
from flashckpt.policy import EverySteps, KeepLast


def _distributed() -> tuple[int, int]:
    """Under torchrun (``--nproc 2``): gloo process group; returns (rank, world size)."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return 0, 1
    import torch.distributed as dist

    from flashckpt.distributed import init_process_group

    init_process_group("gloo")
    return dist.get_rank(), dist.get_world_size()


def build(cfg: dict[str, Any]) -> tuple[GPT, torch.optim.Optimizer, Any, Any, DataLoader[Any]]:
    torch.manual_seed(cfg["seed"])
    rank, world = _distributed()
    text = load_corpus()
    tok = CharTokenizer.from_text(text)
    data = CharDataset(tok.encode(text), block_size=cfg["block_size"], stride=cfg["block_size"])
    model = GPT(GPTConfig(vocab_size=tok.vocab_size, **cfg["model"]))
    if world > 1:  # FSDP2: every block and the root sharded across the ranks
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], weight_decay=0.1)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=cfg["lr"], total_steps=cfg["steps"] + 1)
    sampler = flashckpt.ResumableSampler(
        data, shuffle=True, seed=cfg["seed"], num_replicas=world, rank=rank
    )
    loader = DataLoader(
        data,
        batch_size=cfg["batch_size"],
        sampler=sampler,
        num_workers=1,
        generator=torch.Generator().manual_seed(cfg["seed"]),
    )
    return model, opt, sched, sampler, loader


def main(config_path: str) -> int:
    cfg = json.loads(Path(config_path).read_text())
    torch.set_num_threads(cfg["threads"])
    model, opt, sched, sampler, loader = build(cfg)
    if cfg["recompute"]:
        from flashckpt.memory import RecomputePlan

        RecomputePlan(recompute=tuple(cfg["recompute"]), activation_bytes=0, recompute_s=0.0).apply(
            model
        )
    state = {"model": model, "optim": opt, "sched": sched, "data": sampler, "rng": flashckpt.RNG()}

    ckpt = flashckpt.Checkpointer(
        cfg["disk"],
        memory_tier=cfg["memory"],
        async_save=True,
        incremental=True,
        save_policy=EverySteps(cfg["every"]),
        keep=KeepLast(3),
        keep_memory=KeepLast(2),
    )
    primary = int(os.environ.get("RANK", "0")) == 0
    t0 = time.perf_counter()
    start = ckpt.restore(state) or 0
    restore_s = time.perf_counter() - t0
    log = open(cfg["losses"] if primary else os.devnull, "a")  # noqa: SIM115 - whole run
    log.write(json.dumps({"event": "start", "step": start, "restore_s": restore_s}) + "\n")
    log.flush()
    batches = sampler.wrap(loader)
    for step in range(start + 1, cfg["steps"] + 1):
        x, y = next(batches)
        _, loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        blocking = 0.0
        if ckpt.should_save(step):
            blocking = ckpt.save(step, state).blocking_s
        log.write(json.dumps({"step": step, "loss": loss.item(), "save_ms": blocking * 1e3}) + "\n")
        log.flush()
    ckpt.close()
    log.write(json.dumps({"event": "done", "step": cfg["steps"]}) + "\n")
    log.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
