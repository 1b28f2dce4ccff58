"""A nanoGPT-style loop that resumes bitwise: the batch drawn ahead of the save is saved too.

    python examples/exact_resume.py --root /tmp/er --steps 40 --stop-at 20   # "crashes" at 20
    python examples/exact_resume.py --root /tmp/er --steps 40                # resumes at 20

Like nanoGPT's ``train.py``, the loop fetches the *next* batch inside the step (``X, Y =
get_batch()`` right after the forward pass), with the global torch RNG. At a save point the RNG
is therefore already past a batch that lives only in ``X, Y``: restoring model, optimizer and
RNG alone would draw a different batch, and every loss after the resume would differ. So the
state holds ``{"X": X, "Y": Y}`` as well. ``--no-prefetch-in-state`` leaves it out, to see the
difference. Prints one JSON line ``{"losses": {step: loss}}`` at the end.
"""

from __future__ import annotations

import argparse
import json

import torch

import flashckpt
from flashckpt.demo.data import CharTokenizer, load_corpus
from flashckpt.demo.model import GPT, GPTConfig

BLOCK, BATCH = 32, 4


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--save-every", type=int, default=10)
    ap.add_argument("--stop-at", type=int, default=None, help="leave the loop after this save")
    ap.add_argument("--no-prefetch-in-state", action="store_true")
    args = ap.parse_args()

    text = load_corpus()
    tok = CharTokenizer.from_text(text)
    data = torch.tensor(tok.encode(text))

    def get_batch() -> tuple[torch.Tensor, torch.Tensor]:  # nanoGPT's, on the global RNG
        ix = torch.randint(len(data) - BLOCK - 1, (BATCH,))
        x = torch.stack([data[i : i + BLOCK] for i in ix])
        return x, torch.stack([data[i + 1 : i + 1 + BLOCK] for i in ix])

    torch.manual_seed(1337)
    cfg = GPTConfig(
        vocab_size=tok.vocab_size, block_size=BLOCK, n_layer=1, n_head=2, n_embd=32, dropout=0.1
    )  # dropout draws from the RNG too
    model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.steps)
    X, Y = get_batch()  # the first batch, fetched before the loop as nanoGPT does

    state = {"model": model, "optim": opt, "sched": sched, "rng": flashckpt.RNG()}
    if not args.no_prefetch_in_state:
        state["batch"] = {"X": X, "Y": Y}  # drawn ahead of the save point
    ckpt = flashckpt.Checkpointer(args.root)
    start = ckpt.restore(state) or 0
    if start and not args.no_prefetch_in_state:
        X, Y = state["batch"]["X"], state["batch"]["Y"]
    losses: dict[int, float] = {}
    for step in range(start + 1, args.steps + 1):
        _, loss = model(X, Y)
        X, Y = get_batch()  # prefetch the next batch while the device is busy
        if loss is None:
            raise RuntimeError("GPT returned no loss although targets were given")
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        losses[step] = loss.item()
        if step % args.save_every == 0:
            if "batch" in state:
                state["batch"] = {"X": X, "Y": Y}  # the batch step + 1 will train on
            ckpt.save(step, state)
            if step == args.stop_at:
                break
    ckpt.close()
    print(json.dumps({"losses": losses}))


if __name__ == "__main__":
    main()
