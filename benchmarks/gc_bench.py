"""Garbage-collection cost per save vs the number of retained steps (many small tensors).

    python benchmarks/gc_bench.py --tensors 8192 --retained 2,8,24 --out gc_bench.json
    python benchmarks/gc_bench.py          # default: --retained 2,16 --extra 2 (~45 s of CPU)

For each ``KeepLast(N)`` a fresh root gets ``N + --extra`` synchronous saves of a state of
``--tensors`` small fp32 tensors (64 elements each; 64 of them change per step, so every save
writes a little and retention deletes one step per save once N are kept). Reported, as the
median over the saves after retention started deleting:

* ``save_s``: the whole ``save()`` call (capture, stage, persist, commit, retention, gc);
* ``retain_s``: retention + garbage collection inside it (``TierSet.retain``);
* ``parsed``: manifests parsed by the gc per save (the liveness cache: 0 in steady state);
* ``reparse_all_s``: what re-reading and re-parsing every retained manifest costs, i.e. what
  gc did after every save before the liveness module (measured directly, same root).

Prints a markdown table and writes JSON. fsync stays on; the root is a temporary directory.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

import flashckpt
from flashckpt.engine.tiers import tierset as tiers
from flashckpt.policy import KeepLast
from flashckpt.store import liveness
from flashckpt.store.format.parse import parse_manifest
from flashckpt.store.store import step_name


def run_one(root: Path, *, tensors: int, retained: int, extra: int) -> dict[str, Any]:
    state = {f"p{i}": torch.randn(64) for i in range(tensors)}
    saves, retains, parsed = [], [], []
    counter = {"parsed": 0, "retain_s": 0.0}
    real_parse, real_retain = liveness.parse_manifest, tiers.TierSet.retain

    def counting_parse(data: bytes, *, where: str = "manifest") -> Any:
        counter["parsed"] += 1
        return real_parse(data, where=where)

    def timed_retain(self: tiers.TierSet, tier: tiers.Tier) -> None:
        t0 = time.perf_counter()
        try:
            real_retain(self, tier)
        finally:
            counter["retain_s"] += time.perf_counter() - t0

    liveness.parse_manifest = counting_parse  # type: ignore[assignment]
    tiers.TierSet.retain = timed_retain  # type: ignore[method-assign]
    try:
        with flashckpt.Checkpointer(root, keep=KeepLast(retained)) as ckpt:
            for step in range(retained + extra):
                for i in range(64):
                    state[f"p{(step * 64 + i) % tensors}"].add_(1.0)
                counter["parsed"], counter["retain_s"] = 0, 0.0
                t0 = time.perf_counter()
                ckpt.save(step, state)
                if step >= retained:  # retention deletes one step per save from here on
                    saves.append(time.perf_counter() - t0)
                    retains.append(counter["retain_s"])
                    parsed.append(counter["parsed"])
            kept = ckpt.steps()
    finally:
        liveness.parse_manifest = real_parse
        tiers.TierSet.retain = real_retain  # type: ignore[method-assign]
    t0 = time.perf_counter()
    for s in kept:
        parse_manifest((root / step_name(s)).read_bytes())
    reparse = time.perf_counter() - t0
    return {
        "retained": retained,
        "tensors": tensors,
        "save_s": statistics.median(saves),
        "retain_s": statistics.median(retains),
        "parsed": max(parsed),
        "reparse_all_s": reparse,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tensors", type=int, default=8192)
    ap.add_argument("--retained", default="2,16", help="comma-separated KeepLast(N) values")
    ap.add_argument("--extra", type=int, default=2, help="saves after retention starts")
    ap.add_argument("--dir", default=None, help="where roots go (default: a temp dir)")
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    args = ap.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="gc-bench-") as tmp:
        for n in (int(x) for x in args.retained.split(",")):
            rows.append(
                run_one(Path(tmp) / f"keep{n}", tensors=args.tensors, retained=n, extra=args.extra)
            )
    print("| retained steps | save() | retention + gc | manifests parsed | re-parse all |")
    print("|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['retained']} | {r['save_s'] * 1e3:.0f} ms | {r['retain_s'] * 1e3:.1f} ms "
            f"| {r['parsed']} | {r['reparse_all_s'] * 1e3:.0f} ms |"
        )
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
