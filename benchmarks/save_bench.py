"""Save benchmark.

    python benchmarks/save_bench.py --size-gb 1.2 --out bench.json [--dir DIR] [--gpu]

runs ``flashckpt bench --parts save,rss,gil`` (every method on the same state; markdown table
with PASS/FAIL per target, JSON).

    python benchmarks/save_bench.py --sync-vs-torch [--sizes 10MB,123MiB,1GiB,2GiB] [--dir DIR]

compares a synchronous flashckpt save (the default ``Checkpointer(root)``) with ``torch.save`` +
``os.fsync`` of the same state, into the same directory, interleaved (torch, flashckpt, torch,
...) and the median of each taken, at each size. The state changes between saves (every tensor
+1, outside the timing) so the incremental default writes every chunk. 10 MB and 123 MiB are
the demo GPT with AdamW (123 MiB is nanoGPT's shakespeare-char model); 1 GiB and 2 GiB are
MLPs with AdamW. "first" is the first save of a fresh Checkpointer in this process. A sync save
returns once durable; the deletes of older checkpoints follow on its staging thread, and the
benchmark waits for them (untimed) before each torch.save so neither is timed against them.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

SIZES = {"10MB": 10 * 10**6, "123MiB": 123 << 20, "1GiB": 1 << 30, "2GiB": 2 << 30}
REPEATS = {"10MB": 11, "123MiB": 9, "1GiB": 3, "2GiB": 2}


def gpt_state(nbytes: int) -> dict[str, Any]:
    from flashckpt.demo.model import GPT, GPTConfig

    if nbytes > 50 << 20:  # nanoGPT shakespeare-char: 10.7 M parameters
        cfg = GPTConfig(vocab_size=65, block_size=256, n_layer=6, n_head=6, n_embd=384)
    else:
        cfg = GPTConfig(vocab_size=65, block_size=64, n_layer=4, n_head=4, n_embd=144)
    torch.manual_seed(0)
    model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    idx = torch.randint(cfg.vocab_size, (2, 17))
    model(idx[:, :-1], idx[:, 1:])[1].backward()  # type: ignore[union-attr]
    opt.step()
    return {"model": model, "optim": opt}


def build(name: str) -> dict[str, Any]:
    from flashckpt.cli.bench.impl import build_state

    nbytes = SIZES[name]
    if nbytes <= 200 << 20:
        return gpt_state(nbytes)
    model, opt = build_state(nbytes)
    return {"model": model, "optim": opt}


def nbytes_of(state: dict[str, Any]) -> int:
    from flashckpt.cli.bench.impl import state_nbytes

    return state_nbytes(state["model"], state["optim"])


def torch_save(root: Path, state: dict[str, Any], i: int) -> float:
    from flashckpt.cli.bench.impl import fsync_dir

    path = root / f"torch_{i}.pt"
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        torch.save({k: v.state_dict() for k, v in state.items()}, f)
        f.flush()
        os.fsync(f.fileno())
    fsync_dir(root)
    t = time.perf_counter() - t0
    path.unlink()
    return t


def bump(state: dict[str, Any]) -> None:
    """Every tensor changes, as after a training step (outside the timing)."""
    with torch.no_grad():
        for p in state["model"].parameters():
            p.add_(1)
        for st in state["optim"].state.values():
            for v in st.values():
                if isinstance(v, torch.Tensor) and v.dim() > 0:
                    v.add_(1)


def compare(name: str, root: Path, repeats: int) -> dict[str, Any]:
    from flashckpt import Checkpointer

    state = build(name)
    root = root / name
    root.mkdir(parents=True)
    torch_s: list[float] = []
    flash_s: list[float] = []
    with Checkpointer(root / "flashckpt", keep=2) as ck:
        for i in range(repeats + 1):  # the first flashckpt save is reported on its own
            # a sync save returns once durable and deletes older checkpoints' files on its
            # staging thread afterwards (while training runs); wait for that, untimed, so the
            # torch.save beside it is not measured against those deletes
            ck.wait()
            torch_s.append(torch_save(root, state, i))
            bump(state)
            t0 = time.perf_counter()
            ck.save(i, state)
            flash_s.append(time.perf_counter() - t0)
            bump(state)
    shutil.rmtree(root, ignore_errors=True)
    torch_med, flash_med = statistics.median(torch_s[1:]), statistics.median(flash_s[1:])
    return {
        "state_bytes": nbytes_of(state),
        "repeats": repeats,
        "torch_save_s": torch_med,
        "flashckpt_sync_s": flash_med,
        "ratio": flash_med / torch_med,
        "flashckpt_first_s": flash_s[0],
        "torch_save_first_s": torch_s[0],
        "torch_save_runs_s": [round(x, 4) for x in torch_s],
        "flashckpt_sync_runs_s": [round(x, 4) for x in flash_s],
    }


def sync_vs_torch(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="save_bench.py --sync-vs-torch")
    p.add_argument("--sync-vs-torch", action="store_true")
    p.add_argument("--sizes", default=",".join(SIZES))
    p.add_argument("--dir", default=None, help="where saves go (default: a temp dir on disk)")
    p.add_argument("--repeats", type=int, default=0, help="per size (default: 11, 9, 3, 2)")
    p.add_argument("--out", default="sync_vs_torch.json")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    base = Path(args.dir) if args.dir else Path(tempfile.gettempdir())
    base.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="sync-vs-torch-", dir=base))
    out: dict[str, Any] = {"load_avg_start": os.getloadavg(), "sizes": {}}
    try:
        for name in [s.strip() for s in args.sizes.split(",") if s.strip()]:
            res = compare(name, root, args.repeats or REPEATS[name])
            out["sizes"][name] = res
            print(
                f"| {name} | {res['state_bytes'] / 2**20:.0f} MiB | {res['torch_save_s']:.3f} | "
                f"{res['flashckpt_sync_s']:.3f} | {res['ratio']:.2f} | "
                f"{res['flashckpt_first_s']:.3f} |",
                flush=True,
            )
    finally:
        shutil.rmtree(root, ignore_errors=True)
    out["load_avg_end"] = os.getloadavg()
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"load average {out['load_avg_start']} -> {out['load_avg_end']}; wrote {args.out}")
    return 0


if __name__ == "__main__":
    if "--sync-vs-torch" in sys.argv[1:]:
        sys.exit(sync_vs_torch(sys.argv[1:]))
    from flashckpt.cli import main

    sys.exit(main(["bench", "--parts", "save,rss,gil", *sys.argv[1:]]))
