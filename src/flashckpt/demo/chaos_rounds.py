"""Fair goodput: the chaos methods interleaved in rounds, optionally beside busy processes.

One long block per method lets the host's drift over an hour pick the winner (a neighbour's
job starting in the second half costs only the methods that run then). With ``segments=K`` each
method's share of the wall time is split into K pieces run in K rounds: round ``r`` runs every
method for ``minutes / K`` (a fresh :func:`~flashckpt.demo.chaos.run_chaos` in ``round-r/``, its
baselines around each method included) with one set of kill offsets for all methods of the
round, and the order of the methods rotates from round to round so that none is always first or
last. A method's aggregate goodput is its useful time over its wall time summed over the rounds;
``segments`` lists its goodput per round and ``wins`` counts the rounds it led.

``load=N`` starts N busy processes (pure Python, one core each: data-loader workers or another
job on the host) before the first round and stops them after the last, so every method runs
under the same contention.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from flashckpt.demo.chaos import METHODS, failure_times, run_chaos
from flashckpt.demo.chaos_dirs import check_out, fresh, make_out
from flashckpt.errors import ConfigError

# a busy process: pure Python on one core for as long as the process that started it lives
# (argv[1]: its pid), so a harness killed by any signal, SIGKILL included, leaves none behind
_BUSY = (
    "import os, sys\n"
    "parent = int(sys.argv[1])\n"
    "x = 0\n"
    "while os.getppid() == parent:\n"
    "    for _ in range(200000):\n"
    "        x += 1\n"
)


@contextlib.contextmanager
def busy_load(n: int) -> Iterator[list[int]]:
    """``n`` busy child processes for the duration of the block; yields their pids. They are
    killed at the end even when the block raises, and end by themselves within a fraction of
    a second when this process dies without running the block's end (SIGTERM, SIGKILL)."""
    me = str(os.getpid())
    procs = [subprocess.Popen([sys.executable, "-c", _BUSY, me]) for _ in range(max(0, n))]
    try:
        yield [p.pid for p in procs]
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait()


def run_rounds(
    *,
    out: Path,
    minutes: float,
    mtbf_s: float,
    segments: int,
    load: int = 0,
    methods: Sequence[str] = METHODS,
    seed: int = 0,
    say: Callable[[str], None] = print,
    run: Callable[..., dict[str, Any]] = run_chaos,
    **chaos: Any,
) -> dict[str, Any]:
    """Every method for ``minutes`` in all, in ``segments`` interleaved rounds (see the module
    docstring); ``chaos`` goes to each round's ``run_chaos`` (model, threads, baseline_steps,
    promote_every). Returns the aggregate result (also written to ``out/chaos.json``)."""
    if not isinstance(segments, int) or segments < 1:
        raise ConfigError(f"chaos needs --segments >= 1, got {segments!r}")
    if not isinstance(load, int) or load < 0:
        raise ConfigError(f"chaos needs --load >= 0, got {load!r}")
    methods = list(methods)
    piece = minutes / segments
    out = out.absolute()
    check_out(out, [f"round-{r}" for r in range(segments)])  # never the user's own dirs
    make_out(out)
    rounds: list[dict[str, Any]] = []
    with busy_load(load):
        for r in range(segments):
            order = methods[r % len(methods) :] + methods[: r % len(methods)] if methods else []
            kills = failure_times(seed=seed * 1000 + r, mtbf_s=mtbf_s, duration_s=piece * 60)
            say(f"chaos round {r + 1}/{segments}: {', '.join(order)}")
            rounds.append(
                run(
                    out=fresh(out / f"round-{r}"),
                    minutes=piece,
                    mtbf_s=mtbf_s,
                    methods=order,
                    seed=seed,
                    kills=kills,
                    say=say,
                    **chaos,
                )
            )
    result = aggregate(rounds, methods)
    result.update(minutes=minutes, mtbf_s=mtbf_s, seed=seed, segments=segments, load=load)
    (out / "chaos.json").write_text(json.dumps(result, indent=1))
    return result


def aggregate(rounds: Sequence[dict[str, Any]], methods: Sequence[str]) -> dict[str, Any]:
    """Per method: goodput = sum of useful seconds / sum of wall seconds over the rounds it ran
    in without failing, its goodput per round, the spread, the rounds it led, the failures."""
    out: dict[str, Any] = {"rounds": list(rounds), "methods": {}}
    best_of_round = []
    for rnd in rounds:
        ok = {m: r["goodput"] for m, r in rnd["methods"].items() if "error" not in r}
        best_of_round.append(max(ok, key=lambda m: ok[m]) if ok else None)
    for m in methods:
        runs = [rnd["methods"].get(m, {"error": "not run"}) for rnd in rounds]
        good = [r for r in runs if "error" not in r]
        wall = sum(r["wall_s"] for r in good)
        useful = sum(r["useful_s"] for r in good)
        per = [None if "error" in r else r["goodput"] for r in runs]
        vals = [g for g in per if g is not None]
        out["methods"][m] = {
            "goodput": useful / wall if wall > 0 else None,
            "segments": per,
            "spread": [min(vals), max(vals)] if vals else None,
            "wins": sum(1 for b in best_of_round if b == m),
            "failures": sum(r.get("failures", 0) for r in good),
            "errors": [r["error"] for r in runs if "error" in r],
        }
    return out


def rounds_table(result: dict[str, Any]) -> str:
    """The aggregate table: goodput, its spread over the rounds, the rounds each method led."""
    k = result.get("segments", len(result["rounds"]))
    rows = [
        f"| method | goodput ({k} rounds) | per round (min-max) | rounds led | failures |",
        "|---|---:|---:|---:|---:|",
    ]
    pct = lambda x: "-" if x is None else f"{x:.1%}"  # noqa: E731
    for name, r in result["methods"].items():
        spread = "-" if r["spread"] is None else f"{pct(r['spread'][0])}-{pct(r['spread'][1])}"
        failed = f" ({len(r['errors'])} failed)" if r["errors"] else ""
        rows.append(
            f"| {name} | {pct(r['goodput'])}{failed} | {spread} | {r['wins']}/{k} | "
            f"{r['failures']} |"
        )
    load = result.get("load", 0)
    rows.append(f"\n{load} busy process(es) beside the trainer for the whole run")
    return "\n".join(rows)
