"""Train a small GPT with dropout, AdamW, a scheduler and a shuffled multi-worker DataLoader.

usage: resume_worker.py ROOT OUT MODE TOTAL [K]
  straight: TOTAL steps, write losses + final params to OUT
  crash:    K steps, save, wait until durable, then SIGKILL itself
  resume:   restore, continue to TOTAL, write losses + final params to OUT
"""

import json
import os
import signal
import sys

import torch
from torch.utils.data import DataLoader

import flashckpt
from flashckpt.demo.data import CharDataset, CharTokenizer
from flashckpt.demo.model import GPT, GPTConfig

root, out, mode, total = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
k = int(sys.argv[5]) if len(sys.argv) > 5 else 0
torch.set_num_threads(1)
torch.manual_seed(1234)

text = "the quick brown fox jumps over the lazy dog. " * 40
tok = CharTokenizer.from_text(text)
data = CharDataset(tok.encode(text), block_size=32, stride=7)
model = GPT(
    GPTConfig(vocab_size=tok.vocab_size, block_size=32, n_layer=2, n_head=2, n_embd=32, dropout=0.1)
)
opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + 0.05 * s))
sampler = flashckpt.ResumableSampler(data, shuffle=True, seed=7)
# a DataLoader draws a worker seed from the global RNG whenever an iterator starts; its own
# generator keeps that draw out of the training RNG stream, so resume is exact
loader = DataLoader(
    data, batch_size=8, sampler=sampler, num_workers=2, generator=torch.Generator().manual_seed(0)
)
state = {"model": model, "optim": opt, "sched": sched, "data": sampler, "rng": flashckpt.RNG()}

ckpt = flashckpt.Checkpointer(root, async_save=True)
start = ckpt.restore(state) or 0 if mode == "resume" else 0
stop = k if mode == "crash" else total
losses = []
step = start
batches = sampler.wrap(loader)
while step < stop:
    x, y = next(batches)
    _, loss = model(x, y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    sched.step()
    step += 1
    losses.append(loss.item())
if mode == "crash":
    ckpt.save(step, state).wait()
    with open(out, "w") as f:
        json.dump({"losses": losses}, f)
    os.kill(os.getpid(), signal.SIGKILL)
ckpt.close()
params = {n: p.detach().flatten().tolist() for n, p in model.state_dict().items()}
with open(out, "w") as f:
    json.dump({"start": start, "losses": losses, "params": params}, f)
