"""``flashckpt demo``: plan -> train with tiered async checkpoints -> crash -> resume -> report.

The training runs in a child process (:mod:`flashckpt.demo.train`) that this process kills with
SIGKILL part-way, exactly as a preempted or crashed job dies; a new child then resumes from the
memory tier, redoes the steps lost since the last checkpoint, and must produce the very same
losses for them.
"""

from __future__ import annotations

import contextlib
import getpass
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from flashckpt.demo.steps import plan_memory, say, show_report

MODEL = {"block_size": 128, "n_layer": 6, "n_head": 6, "n_embd": 192, "dropout": 0.1}


def default_config(out: Path, *, steps: int, every: int) -> dict[str, Any]:
    shm = Path("/dev/shm") if Path("/dev/shm").is_dir() else out
    return {
        "seed": 1337,
        "steps": steps,
        "every": every,
        "lr": 3e-3,
        "batch_size": 16,
        "block_size": MODEL["block_size"],
        "model": MODEL,
        "threads": max(1, min(4, os.cpu_count() or 1)),
        "disk": str(out / "ckpt"),
        "memory": str(shm / f"flashckpt-demo-{getpass.getuser()}-{abs(hash(str(out))) % 10**6}"),
        "losses": str(out / "losses.jsonl"),
        "recompute": [],
    }


def run_demo(
    *, out: Path, steps: int = 200, every: int = 20, crash_at: int | None = None, nproc: int = 1
) -> int:
    out = out.absolute()
    if out.exists() and any(out.iterdir()):
        raise SystemExit(f"{out} is not empty; pass --dir to a new directory or remove it")
    out.mkdir(parents=True, exist_ok=True)
    cfg = default_config(out, steps=steps, every=every)
    if nproc > 1:  # FSDP2 over gloo ranks on this machine; the disk tier is shared by the ranks
        cfg.update(nproc=nproc, memory=None, threads=1)
    crash_at = crash_at or int(steps * 0.65)
    say(
        f"flashckpt demo · {torch.__version__} · {'cuda' if torch.cuda.is_available() else 'cpu'} "
        f"· output in {out}"
    )
    cfg["recompute"] = plan_memory(cfg)
    cfg_path = out / "config.json"
    cfg_path.write_text(json.dumps(cfg, indent=1))

    where = f"memory tier {cfg['memory']} and disk tier" if cfg["memory"] else "disk tier"
    ranks = f" on {nproc} ranks (FSDP2 over gloo)" if nproc > 1 else ""
    say(
        f"\n[2/4] training {steps} steps{ranks}; async incremental checkpoint every {every} "
        f"steps to {where} {cfg['disk']}; crash planned at step {crash_at}"
    )
    before = _train(cfg_path, cfg, kill_at=crash_at)
    survived = "the memory tier survived the crash" if cfg["memory"] else "from the disk tier"
    say(f"\n[3/4] resuming in a new process ({survived})")
    after = _train(cfg_path, cfg, kill_at=None)
    ok = _compare(before, after)
    show_report(cfg, out)
    return 0 if ok else 1


def _train(cfg_path: Path, cfg: dict[str, Any], *, kill_at: int | None) -> dict[int, float]:
    losses_path = Path(cfg["losses"])
    offset = len(_read(losses_path))
    cmd = [sys.executable, "-m", "flashckpt.demo.train", str(cfg_path)]
    if cfg.get("nproc", 1) > 1:
        cmd[1:2] = [
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={cfg['nproc']}",
            "-m",
        ]
    proc = subprocess.Popen(cmd, start_new_session=True)  # its own group: kill every rank
    t0 = time.monotonic()
    losses: dict[int, float] = {}
    while True:
        lines = _read(losses_path)[offset:]
        for rec in lines:
            offset += 1
            if rec.get("event") == "start":
                tier = "the memory tier" if cfg["memory"] else "the disk tier"
                where = f"from {tier}" if rec["step"] else "(no checkpoint yet)"
                say(
                    f"  started at step {rec['step']} {where}; restore took {rec['restore_s']:.2f}s"
                )
            elif "step" in rec and "loss" in rec:
                losses[rec["step"]] = rec["loss"]
                _progress(rec, cfg, t0)
                if kill_at is not None and rec["step"] >= kill_at:
                    _kill_group(proc)
                    say(f"\n  ✗ killed the training process with SIGKILL at step {rec['step']}")
                    return losses
        if proc.poll() is not None and not _read(losses_path)[offset:]:
            if proc.returncode != 0:
                raise SystemExit(f"training process failed with exit code {proc.returncode}")
            print()
            return losses
        time.sleep(0.05)


def _progress(rec: dict[str, Any], cfg: dict[str, Any], t0: float) -> None:
    step = rec["step"]
    save = f" · saved (blocked {rec['save_ms']:.1f} ms)" if rec.get("save_ms") else ""
    elapsed = time.monotonic() - t0
    line = f"  step {step:4d}/{cfg['steps']} · loss {rec['loss']:.4f} · {elapsed:5.1f}s{save}"
    if sys.stdout.isatty() and not save:
        print("\r" + line, end="", flush=True)
    elif save or step % 25 == 0:
        print("\r" + line, flush=True)


def _compare(before: dict[int, float], after: dict[int, float]) -> bool:
    redone = sorted(set(before) & set(after))
    if not redone:
        say("  (the crash came right after a checkpoint: no steps had to be redone)")
        return True
    same = all(before[s] == after[s] for s in redone)
    mark = "✓ bitwise identical" if same else "✗ DIFFERENT"
    say(f"  steps {redone[0]}–{redone[-1]} were lost in the crash and redone: losses {mark}")
    for s in redone[:3]:
        say(f"    step {s}: before crash {before[s]:.6f} · after resume {after[s]:.6f}")
    return same


def _read(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            break  # a line still being written
    return out


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL the trainer and every process below it (torchrun puts each rank in its own
    session, so a process-group kill is not enough), then wait until all are gone: a writer
    lock is released only when its process has exited."""
    victims = [proc.pid, *_descendants(proc.pid)]
    for pid in victims:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(
        Path(f"/proc/{pid}/stat").exists() and _state(pid) != "Z" for pid in victims
    ):
        time.sleep(0.05)


def _descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "Z"
