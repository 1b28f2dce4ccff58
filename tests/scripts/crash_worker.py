"""Saves step after step until killed. Step s holds w = arange(n) + s, so content is checkable."""

import sys

import torch

import flashckpt

root, mode = sys.argv[1], sys.argv[2]
torch.set_num_threads(1)
N = 256 * 1024
ckpt = flashckpt.Checkpointer(root, async_save=mode == "async", chunk_size="128KiB", keep=4)
steps = ckpt.steps()
start = steps[-1] + 1 if steps else 0
print("ready", flush=True)
base = torch.arange(N, dtype=torch.float32)
for step in range(start, start + 10_000):
    state = {
        "w": base + step,
        "small": {f"b{i}": torch.full((8,), float(step)) for i in range(50)},
        "meta": {"step": step},
    }
    handle = ckpt.save(step, state)
    handle.durable.add_done_callback(lambda f, s=step: print(f"durable {s}", flush=True))
