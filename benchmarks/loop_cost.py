"""What a save costs a training loop, side by side with the peers and the memcpy floor.

    python benchmarks/loop_cost.py [--profiles dispatch,compute,contended] [--out cost.json]

(also ``flashckpt bench --parts loop-cost``). See :mod:`flashckpt.cli.bench.cost` for the
loops, the methods and how the cost per save is measured.
"""

from __future__ import annotations

import argparse
import json
import sys

from flashckpt.cli.bench import cost as bench_cost


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--profiles", default=",".join(bench_cost.PROFILES))
    p.add_argument("--methods", default=",".join(bench_cost.METHODS))
    p.add_argument("--state-mib", type=int, default=256)
    p.add_argument("--tensors", type=int, default=96)
    p.add_argument("--steps", type=int, default=70)
    p.add_argument("--every", type=int, default=10)
    p.add_argument("--load", type=int, default=2, help="busy processes in the contended profile")
    p.add_argument("--rounds", type=int, default=1, help="repeat each method, rotating order")
    p.add_argument("--dir", default=None, help="where the runs write (default: the temp dir)")
    p.add_argument("--out", default=None, help="write the JSON result here")
    a = p.parse_args(argv)
    res = bench_cost.run(
        profiles=tuple(x for x in a.profiles.split(",") if x),
        methods=tuple(x for x in a.methods.split(",") if x),
        state_bytes=a.state_mib << 20,
        tensors=a.tensors,
        steps=a.steps,
        every=a.every,
        load=a.load,
        rounds=a.rounds,
        work_dir=a.dir,
        say=lambda m: print(m, file=sys.stderr),
    )
    print(bench_cost.table(res))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
