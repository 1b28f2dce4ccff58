"""The chaos benchmark: goodput under real failures, side by side, with the same failure times.

``flashckpt_standby`` is ``flashckpt`` run under ``flashckpt run --standby 1``: the kills hit the
process the launcher's state file names as the active one, and the launcher (not this driver)
restarts it, by handing over to its warm standby.

For each method, train the demo GPT in a child process (:mod:`flashckpt.demo.chaos_train`) for
``minutes`` of wall time while this process SIGKILLs it at exponentially distributed instants
(mean ``mtbf_s``, seeded, drawn once and used for every method) and restarts it at once, as a
job scheduler restarting a failed job would. Then :mod:`flashckpt.demo.chaos_stats` computes
goodput, lost steps, save blocking, restore and restart seconds from the child's log. The
flashckpt run also gets its HTML report (from its journal). A baseline process trains
``baseline_steps`` steps with no checkpointing and no kills before the first method and again
after each one: the mean of the medians just before and just after a method is the useful time
of one of its steps (what checkpointing slows down counts as waste, what the host's own drift
does during the hour and a half does not), and the first baseline's start is the cold start of
the script with nothing to checkpoint.
"""

from __future__ import annotations

import contextlib
import getpass
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from flashckpt.demo.chaos_dirs import check_out, fresh, make_out
from flashckpt.demo.chaos_stats import analyze, baseline_step_s
from flashckpt.errors import ConfigError
from flashckpt.journal import read_events

METHODS = ("flashckpt", "flashckpt_standby", "torch_save", "dcp_async_save")
FLASHCKPT = ("flashckpt", "flashckpt_standby")  # journaled methods (restart parts, report)
# ~23M parameters: about 370 MB of model + AdamW state, inside the 200-500 MB the issue asks for
MODEL = {"block_size": 128, "n_layer": 7, "n_head": 8, "n_embd": 512}
SMOKE_MODEL = {"block_size": 32, "n_layer": 2, "n_head": 2, "n_embd": 64}


def failure_times(*, seed: int, mtbf_s: float, duration_s: float) -> list[float]:
    """Kill offsets (seconds after a method's start), exponential gaps of mean ``mtbf_s``."""
    rng = random.Random(seed)
    out: list[float] = []
    t = 0.0
    while True:
        t += rng.expovariate(1.0 / mtbf_s)
        if t >= duration_s:
            return out
        out.append(round(t, 3))


def run_chaos(
    *,
    out: Path,
    minutes: float,
    mtbf_s: float,
    methods: Sequence[str] = METHODS,
    seed: int = 0,
    model: dict[str, int] | None = None,
    threads: int | None = None,
    kills: Sequence[float] | None = None,
    baseline_steps: int = 20,
    promote_every: int = 1,
    say: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Run every method; returns (and writes to ``out/chaos.json``) the whole result.
    ``kills``: kill offsets to use instead of drawing them (e.g. a previous run's
    ``failure_times_s``, to replay it); ``baseline_steps=0`` skips the baseline (each method's
    own median step then stands in for the undisturbed one). ``promote_every``: flashckpt copies
    every that-many-th memory-tier checkpoint to disk (``Promotion(every=)``)."""
    bad = [m for m in methods if m not in METHODS]
    if bad or not methods:
        raise ConfigError(f"unknown chaos method(s) {bad}; choose from {', '.join(METHODS)}")
    # NaN compares false with everything (it passed "<= 0" and hung the run), inf never ends,
    # and an MTBF under a second only kills
    if not (0 < minutes <= 7 * 24 * 60) or not (1 <= mtbf_s <= 1e9):
        raise ConfigError(
            f"chaos needs 0 < --minutes <= 10080 and 1 <= --mtbf-s <= 1e9 (finite), got "
            f"{minutes!r} and {mtbf_s!r}"
        )
    if not isinstance(promote_every, int) or promote_every < 1:
        raise ConfigError(f"chaos needs --promote-every >= 1, got {promote_every!r}")
    out = out.absolute()
    check_out(out, ["none", *methods])  # the user's own directories are refused, never deleted
    make_out(out)
    duration = minutes * 60.0
    if kills is None:
        kills = failure_times(seed=seed, mtbf_s=mtbf_s, duration_s=duration)
    kills = sorted(k for k in kills if 0 < k < duration)
    say(
        f"chaos: {len(kills)} failures in {duration:.0f}s per method "
        f"(MTBF {mtbf_s:g}s, seed {seed})"
    )
    result: dict[str, Any] = {
        "minutes": minutes,
        "mtbf_s": mtbf_s,
        "seed": seed,
        "failure_times_s": kills,
        "model": model or MODEL,
        "promote_every": promote_every,
        "methods": {},
    }

    def baseline() -> dict[str, Any] | None:
        if baseline_steps <= 0:
            return None
        cfg = _config(out, "none", mtbf_s=mtbf_s, seed=seed, model=model, threads=threads)
        got = _run_baseline(cfg, baseline_steps)
        result["baselines_s"].append(got["step_s"])
        say(f"  baseline (no checkpointing): {got['step_s']:.3f} s/step")
        return got

    result["baselines_s"] = []  # the baseline's step before the first method and after each
    before = baseline()
    if before is not None:
        result["baseline"] = before
    for method in methods:
        cfg = _config(
            out, method, mtbf_s=mtbf_s, seed=seed, model=model, threads=threads,
            promote_every=promote_every,
        )  # fmt: skip
        try:
            measured = _run_method(cfg, kills, duration)
            after = baseline()
            res = measured(_bracket(before, after))
            if before is not None and after is not None:
                res["baseline_before_s"] = before["step_s"]
                res["baseline_after_s"] = after["step_s"]
                before = after
        except Exception as exc:  # one method's failure must not lose the others' results
            result["methods"][method] = {"error": f"{type(exc).__name__}: {exc}"}
            say(f"  {method}: FAILED ({exc}); see {Path(cfg['log']).parent}")
        else:
            result["methods"][method] = res
            say(f"  {method}: goodput {res['goodput']:.1%}, {res['failures']} failures")
        (out / "chaos.json").write_text(json.dumps(result, indent=1))  # after every method
    return result


def _config(
    out: Path,
    method: str,
    *,
    mtbf_s: float,
    seed: int,
    model: dict[str, int] | None,
    threads: int | None,
    promote_every: int = 1,
) -> dict[str, Any]:
    d = fresh(out / method)  # emptied only when an earlier chaos run created it
    shm = Path("/dev/shm") if Path("/dev/shm").is_dir() else d
    cfg = {
        "method": method,
        "mtbf_s": mtbf_s,
        "seed": seed,
        "model": model or MODEL,
        "batch_size": 8,
        "steps": 10**9,
        "threads": threads or max(1, min(4, os.cpu_count() or 1)),
        "root": str(d / "root"),
        "memory": str(shm / f"flashckpt-chaos-{getpass.getuser()}-{os.getpid()}-{method}"),
        "log": str(d / "train.jsonl"),
    }
    if method in FLASHCKPT:
        cfg["promote_every"] = promote_every  # Promotion(every=) of its Checkpointer
    (d / "config.json").write_text(json.dumps(cfg, indent=1))
    return cfg


def _bracket(before: dict[str, Any] | None, after: dict[str, Any] | None) -> float | None:
    """A method's useful step time: the mean of the baselines around it (None: no baseline,
    the method's own median step stands in)."""
    steps = [b["step_s"] for b in (before, after) if b is not None]
    return sum(steps) / len(steps) if steps else None


def _run_baseline(cfg: dict[str, Any], steps: int) -> dict[str, Any]:
    """Train ``steps`` steps with no checkpointing and no kills, to the end."""
    cfg["steps"] = steps
    cfg_path = Path(cfg["log"]).with_name("config.json")
    cfg_path.write_text(json.dumps(cfg, indent=1))
    t0 = time.time()
    proc = _spawn([sys.executable, "-m", "flashckpt.demo.chaos_train", str(cfg_path)])
    if proc.wait() != 0:
        raise RuntimeError(f"chaos baseline trainer exited with {proc.returncode}")
    records = _read(Path(cfg["log"]))
    steps_done = [r for r in records if r.get("event") == "step"]
    step_s = baseline_step_s(records)
    if step_s is None or not steps_done:
        raise RuntimeError("chaos baseline trained no step")
    return {"steps": len(steps_done), "step_s": step_s, "cold_start_s": steps_done[0]["t"] - t0}


def _run_method(
    cfg: dict[str, Any], kills: Sequence[float], duration: float
) -> Callable[[float | None], dict[str, Any]]:
    """Run one method with its kills; returns its analysis as a function of the useful step
    time (known once the baseline after it ran)."""
    cfg_path = Path(cfg["log"]).with_name("config.json")
    cmd = [sys.executable, "-m", "flashckpt.demo.chaos_train", str(cfg_path)]
    standby = cfg["method"] == "flashckpt_standby"
    state_file = cfg_path.with_name("launcher.json")
    if standby:  # flashckpt run keeps a standby and restarts the trainer itself
        launcher = [sys.executable, "-m", "flashckpt.cli", "run", "--standby", "1"]
        cmd = [*launcher, "--max-restarts", "100000", "--state-file", str(state_file), "--", *cmd]
    t0_mono, t0 = time.monotonic(), time.time()
    killed_at: list[float] = []
    pending = list(kills)
    proc = _spawn(cmd)
    try:
        while True:
            elapsed = time.monotonic() - t0_mono
            if elapsed >= duration:
                break
            if pending and elapsed >= pending[0]:
                pending.pop(0)
                if standby:
                    _kill_active(state_file)
                else:
                    _kill(proc)
                killed_at.append(time.time())
                if not standby:
                    proc = _spawn(cmd)
            elif proc.poll() is not None:
                raise RuntimeError(f"chaos trainer ({cfg['method']}) exited with {proc.returncode}")
            time.sleep(0.01)
    finally:
        if standby:
            _end_launcher(proc, state_file)
        _kill(proc)
        t_end = time.time()
        shutil.rmtree(cfg["memory"], ignore_errors=True)
    records = _read(Path(cfg["log"]))
    journal = read_events(cfg["root"]) if cfg["method"] in FLASHCKPT else None
    report = _report(Path(cfg["root"])) if cfg["method"] in FLASHCKPT else None

    def measured(base_step_s: float | None) -> dict[str, Any]:
        res = analyze(
            records, kills=killed_at, t0=t0, t_end=t_end, journal=journal, base_step_s=base_step_s
        ).as_dict()
        if report is not None:
            res["report"] = report
        return res

    return measured


def _spawn(cmd: list[str]) -> subprocess.Popen[bytes]:
    env = {**os.environ, "FLASHCKPT_CHAOS_SPAWN_T": repr(time.time())}
    return subprocess.Popen(cmd, start_new_session=True, env=env)


def _kill(proc: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def _launched(state_file: Path) -> dict[str, Any]:
    try:
        got = json.loads(state_file.read_text())
    except (OSError, ValueError):
        return {}
    return got if isinstance(got, dict) else {}


def _kill_active(state_file: Path) -> None:
    """SIGKILL the process ``flashckpt run`` says is the active trainer (its process group)."""
    for pid in _launched(state_file).get("active", []):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)


def _end_launcher(proc: subprocess.Popen[bytes], state_file: Path) -> None:
    """Stop the launcher, then SIGKILL what it ran (active and standby, each its own group)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    st = _launched(state_file)
    for pid in [*st.get("active", []), *st.get("standby", [])]:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)


def _read(path: Path) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    if not path.exists():
        return out
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue  # the line a killed process was writing
        if isinstance(rec, dict):
            out.append(rec)
    return out


def _report(root: Path) -> str | None:
    from flashckpt.report.html import write_report

    try:
        return str(write_report(root, output=str(root.parent / "report.html")))
    except Exception as exc:  # the benchmark's numbers stand without the page
        return f"report failed: {exc}"
