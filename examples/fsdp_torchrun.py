"""Train a small GPT with FSDP2 under torchrun, checkpointing with flashckpt, and resume.

    torchrun --nproc_per_node 2 examples/fsdp_torchrun.py --root /tmp/x --steps 20

Run it again with more ``--steps`` and it resumes from the newest checkpoint, on any number of
processes (a checkpoint saved by 2 ranks loads on 1, 3 or 4: each rank reads only the bytes
of its own shards). ``--crash-at N`` kills every rank at step N on the first attempt, once the
last save is durable, so with ``torchrun --max-restarts 1`` you see a crash and an automatic
resume from that save in one command.

Multi-node: ``torchrun --nnodes 2 --node-rank <i> --rdzv-endpoint host:29500 ...`` with
``--root`` on a filesystem every node sees (docs/guides/distributed.md).
Uses NCCL + CUDA when available, else gloo on CPU.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import flashckpt
from flashckpt.demo.data import CharTokenizer, load_corpus
from flashckpt.demo.model import GPT, GPTConfig


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--root", required=True, help="checkpoint directory (shared by all nodes)")
    p.add_argument("--steps", type=int, default=20, help="train until this step")
    p.add_argument("--save-every", type=int, default=5)
    p.add_argument("--batch", type=int, default=8, help="sequences per rank per step")
    p.add_argument("--crash-at", type=int, default=None, help="os._exit at this step (1st try)")
    p.add_argument("--timeout", type=float, default=120.0, help="dist_timeout_s")
    return p.parse_args()


def batch(tokens: torch.Tensor, step: int, rank: int, size: int, block: int) -> torch.Tensor:
    """The data position is the step: batch (step, rank) is the same on every attempt."""
    g = torch.Generator().manual_seed(step * 1009 + rank)
    starts = torch.randint(0, len(tokens) - block - 1, (size,), generator=g)
    return torch.stack([tokens[s : s + block + 1] for s in starts.tolist()])


def main() -> int:
    args = parse()
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    try:
        return train(args, cuda)
    finally:
        # teardown order: train() closed the Checkpointer (its last save durable, its threads
        # done) and every rank passed the final barrier, so no rank is still inside a
        # collective when the process groups go away; only then destroy them, on every path
        dist.destroy_process_group()


def train(args: argparse.Namespace, cuda: bool) -> int:
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else None
    if device is not None:
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    text = load_corpus()
    tok = CharTokenizer.from_text(text)
    tokens = torch.tensor(tok.encode(text))
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=tok.vocab_size, block_size=64, n_layer=2, n_head=4, n_embd=64)
    model = GPT(cfg).to(device) if device is not None else GPT(cfg)
    mesh = init_device_mesh("cuda" if cuda else "cpu", (world,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    torch.manual_seed(1234 + rank)  # per-rank RNG, saved and restored per rank
    state = {"model": model, "optim": opt, "rng": flashckpt.RNG()}
    with flashckpt.Checkpointer(args.root, async_save=True, dist_timeout_s=args.timeout) as ckpt:
        start = ckpt.restore(state) or 0
        attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
        if rank == 0:
            print(f"attempt {attempt}: world {world}, resumed from step {start}", flush=True)
        t0 = time.perf_counter()
        for step in range(start + 1, args.steps + 1):
            if args.crash_at == step and attempt == 0:
                # the demo's crash comes once the last save is durable, so what it loses is
                # always the steps since then (an async save still in flight when a process
                # dies is lost, and the resume starts from the save before)
                ckpt.wait()
                print(f"rank {rank}: crashing at step {step}", flush=True)
                os._exit(1)
            xy = batch(tokens, step, rank, args.batch, cfg.block_size)
            if device is not None:
                xy = xy.to(device)
            _, loss_t = model(xy[:, :-1], xy[:, 1:])
            if loss_t is None:
                raise RuntimeError("GPT returned no loss although targets were given")
            opt.zero_grad()
            loss_t.backward()
            opt.step()
            if step % args.save_every == 0:
                ckpt.save(step, state)
            if rank == 0 and (step % 5 == 0 or step == args.steps):
                print(f"step {step:4d}  loss {loss_t.item():.4f}", flush=True)
    # the with block closed the Checkpointer: the last save is durable on every rank
    total = sum(p.full_tensor().double().sum().item() for p in model.parameters())  # type: ignore[attr-defined]
    dist.barrier()  # every rank is past its last collective before any rank tears down
    if rank == 0:
        print(f"done: step {args.steps}, {time.perf_counter() - t0:.1f}s, checksum {total:.10e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
