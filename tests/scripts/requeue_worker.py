"""One attempt of a requeued job (tests/core/test_requeue.py): restore, save steps, then wait
to be SIGKILLed. Step s of an attempt with ``base`` b holds w = arange(n) + s + b.

argv: root memory_tier every base steps(comma-separated) [norestore]
"""

import sys

import torch

import flashckpt
from flashckpt.engine.tiers.promote import Promotion

root, mem, every, base, steps = sys.argv[1:6]
restore = "norestore" not in sys.argv[6:]
torch.set_num_threads(1)
N = 64 * 1024
ckpt = flashckpt.Checkpointer(
    root,
    memory_tier=mem,
    keep_memory=10,
    promotion=Promotion(every=int(every)),
    chunk_size="64KiB",
)
state = {"w": torch.zeros(N), "meta": None}
if restore:
    print(f"restored {ckpt.restore(state)}", flush=True)
for step in [int(s) for s in steps.split(",")]:
    w = torch.arange(N, dtype=torch.float32) + step + float(base)
    ckpt.save(step, {"w": w, "meta": {"step": step, "base": float(base)}}).durable.result()
ckpt.wait_promoted()
print("ready", flush=True)
sys.stdin.read()  # until SIGKILLed (the test never closes stdin)
