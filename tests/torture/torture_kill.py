"""Kill trials: real training processes SIGKILLed at random (seeded) instants.

One session = one seed, one checkpoint root with a memory tier, a lock-free reader process
(``flashckpt ls`` / ``verify`` in a loop) and a ``flashckpt gc`` loop running the whole time.
Each kill starts a worker (``torture_worker.py``: restore, then train and save every step,
promote, retain), waits a random delay, and SIGKILLs it — sometimes the gc loop too. After each
kill the checker re-opens the root as a user would and asserts:

* the newest checkpoint is at least the newest step the worker reported durable, and every
  step any tier holds restores bitwise equal to the deterministic training state of that step;
* ``flashckpt verify`` exits 0 on the root and on the memory tier;
* after that clean run and a ``flashckpt gc``, no temporary file is left;
* at the end: every damage report of the concurrent reader was real.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import random
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torture_faults import count
from torture_known import record_hit, tolerated
from torture_model import build, expected, same, snapshot
from torture_oracle import Violation, ViolationError, disk_steps, inspect_step, temp_files

import flashckpt
from flashckpt.cli import main as cli_main

KILLS_PER_SESSION = 5
HERE = Path(__file__).parent


def repro(seed: int) -> str:
    return f"FLASHCKPT_TORTURE_SEED={seed} python -m pytest tests/torture/test_kill.py -k kill -x"


class ForkServer:
    """``torture_worker.py serve``: imports torch once, forks every worker, reader and gc loop
    (a fresh interpreter per kill would spend seconds importing torch on a busy machine)."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(HERE / "torture_worker.py"), "serve"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=HERE,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if line.strip() != "server ready":
            raise RuntimeError(f"the fork server did not start: {line!r}")

    def spawn(self, mode: str, out: Path, *args: str) -> int:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(" ".join([mode, str(out), *args]) + "\n")
        self.proc.stdin.flush()
        return int(self.proc.stdout.readline())

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait(timeout=60)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def sigkill(pid: int | None) -> None:
    """SIGKILL ``pid`` and wait until the kernel has reaped it."""
    if pid is None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 60
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.002)


def _lines(p: Path) -> list[str]:
    try:
        return p.read_text().splitlines()
    except FileNotFoundError:
        return []


@dataclass
class KillSession:
    base: Path
    seed: int
    kills: int = KILLS_PER_SESSION
    rng: random.Random = field(init=False)
    root: Path = field(init=False)
    mem: Path = field(init=False)
    durable: int | None = None
    known: list[Violation] = field(default_factory=list)
    log: list[str] = field(default_factory=list)
    server: ForkServer | None = None
    temp_seen: set[str] = field(default_factory=set)
    _bg: dict[str, int | None] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.rng = random.Random(f"kill|{self.seed}")
        self.root = self.base / "root"
        shm = Path("/dev/shm")
        use_shm = shm.is_dir() and os.access(shm, os.W_OK)
        tag = f"{os.getpid()}-{self.seed}-{uuid.uuid4().hex[:8]}"
        self.mem = (shm if use_shm else self.base) / f"flashckpt-torture-{tag}"

    def fail(self, invariant: str, detail: str) -> None:
        v = Violation(invariant, f"kill seed {self.seed}: {detail}")
        count(f"violation.{invariant}")
        if tolerated(invariant):
            self.known.append(v)
            record_hit(v, "; ".join(self.log[-4:]))
            return
        tail = "\n  ".join(self.log[-8:])
        raise ViolationError(
            Violation(invariant, f"{v.detail}\n  log:\n  {tail}\n  reproduce: {repro(self.seed)}")
        )

    # -- background processes ---------------------------------------------------------------
    def start_bg(self, mode: str) -> None:
        assert self.server is not None
        out = self.base / f"{mode}.jsonl"
        self._bg[mode] = self.server.spawn(mode, out, str(self.root), str(self.mem))

    def stop_bg(self) -> None:
        for pid in self._bg.values():
            sigkill(pid)
        self._bg.clear()

    # -- the session ------------------------------------------------------------------------
    def run(self) -> None:
        try:
            self.start_bg("read")
            self.start_bg("gc")
            for i in range(self.kills):
                self.one_kill(i)
            self.check_reader()
        finally:
            self.stop_bg()
            import shutil

            shutil.rmtree(self.mem, ignore_errors=True)

    def one_kill(self, i: int) -> None:
        worker_seed = self.rng.randrange(1 << 30)
        delay = self.rng.uniform(0.0, 1.5)
        also_gc = self.rng.random() < 0.3
        exit_after = self.rng.randint(1, 6) if self.rng.random() < 0.2 else -1
        if exit_after >= 0:
            self.exit_trial(i, worker_seed, exit_after)
            return
        if self.rng.random() < 0.2:
            self.manifest_trial(i, worker_seed, self.rng.randint(1, 6))
            return
        self.log.append(f"kill {i}: worker seed {worker_seed}, delay {delay:.3f}s, gc {also_gc}")
        assert self.server is not None
        out = self.base / f"worker-{i}.log"
        pid = self.server.spawn("worker", out, str(self.root), str(self.mem), str(worker_seed))
        deadline = time.monotonic() + 180
        while not any(x.startswith("ready") for x in _lines(out)):
            if not alive(pid):
                self.fail("worker_died", f"worker died before ready: {out.read_text()[-2000:]}")
                return
            if time.monotonic() > deadline:
                sigkill(pid)
                self.fail("worker_stuck", "worker not ready after 180 s")
                return
            time.sleep(0.005)
        self.log.append(f"  ready after {time.monotonic() - deadline + 180:.1f}s")
        time.sleep(delay)
        sigkill(pid)
        count("kills")
        if also_gc:
            sigkill(self._bg.get("gc"))
            count("kills")
            count("kills.gc")
        lines = _lines(out)
        count(f"kills.during.{self.phase(pid)}")
        if any("Traceback" in x for x in lines):
            self.fail("worker_error", f"the worker raised: {out.read_text()[-2000:]}")
        steps = [int(x.split()[1]) for x in lines if x.startswith("durable")]
        if steps:
            self.durable = max(steps + ([self.durable] if self.durable is not None else []))
        self.log.append(
            f"  worker printed {len(steps)} durable steps; newest durable {self.durable}"
        )
        t0 = time.monotonic()
        self.check_after_kill()
        self.log.append(f"  checked in {time.monotonic() - t0:.1f}s")
        if also_gc:
            self.start_bg("gc")

    def exit_trial(self, i: int, worker_seed: int, exit_after: int) -> None:
        """The worker ends normally after ``exit_after`` saves, its last save in flight and no
        close(): that save completes, or is journaled as abandoned; never an error."""
        assert self.server is not None
        self.log.append(f"exit {i}: worker seed {worker_seed}, ends after {exit_after} saves")
        out = self.base / f"worker-{i}.log"
        pid = self.server.spawn(
            "worker", out, str(self.root), str(self.mem), str(worker_seed), str(exit_after)
        )
        deadline = time.monotonic() + 120
        while alive(pid) and time.monotonic() < deadline:
            time.sleep(0.01)
        if alive(pid):
            sigkill(pid)
            self.fail("exit_hang", "a worker ending with a save in flight did not exit in 120 s")
        count("exits")
        text = out.read_text() if out.exists() else ""
        steps = [int(x.split()[1]) for x in text.splitlines() if x.startswith("durable")]
        if steps:
            self.durable = max([*steps, *([self.durable] if self.durable is not None else [])])
        failed = [  # "abandoned at exit" is allowed when journaled; an exit error is not
            e
            for e in self.events(pid)
            if e.get("event") == "save_failed" and "after shutdown" in str(e.get("error"))
        ]
        if "Traceback" in text or failed:
            why = failed[-1].get("error") if failed else text[-600:]
            self.fail("exit_with_save_in_flight", f"ending with a save in flight: {why}")
        self.check_after_kill()

    def manifest_trial(self, i: int, worker_seed: int, nth: int) -> None:
        """The worker SIGKILLs itself right after its ``nth`` step manifest lands in the memory
        tier, before that save reports: the step's outcome is unknown (it may be restored,
        then bitwise the training state of that step), and no step reported durable is lost."""
        assert self.server is not None
        self.log.append(f"manifest {i}: worker seed {worker_seed}, dies after manifest {nth}")
        out = self.base / f"worker-{i}.log"
        args = (str(worker_seed), "-1", "0", "0", str(nth))
        pid = self.server.spawn("worker", out, str(self.root), str(self.mem), *args)
        deadline = time.monotonic() + 180
        while alive(pid) and time.monotonic() < deadline:
            time.sleep(0.005)
        if alive(pid):
            sigkill(pid)
            self.fail("worker_stuck", f"no manifest {nth} after 180 s: {out.read_text()[-800:]}")
            return
        text = out.read_text() if out.exists() else ""
        if "killed after the manifest" not in text or "Traceback" in text:
            self.fail("worker_error", f"the worker did not die after a manifest: {text[-2000:]}")
            return
        count("kills")
        count("kills.after_manifest")
        steps = [int(x.split()[1]) for x in text.splitlines() if x.startswith("durable")]
        if steps:
            self.durable = max([*steps, *([self.durable] if self.durable is not None else [])])
        self.log.append(f"  {text.splitlines()[-1]}; newest durable {self.durable}")
        self.check_after_kill()

    def events(self, pid: int) -> list[dict[str, Any]]:
        out = []
        for ln in _lines(self.root / "journal.jsonl"):
            with contextlib.suppress(ValueError):
                e = json.loads(ln)
                if isinstance(e, dict) and e.get("pid") == pid:
                    out.append(e)
        return out

    def phase(self, pid: int) -> str:
        """What the killed worker was doing, from its last journal event: ``save_start`` /
        ``staged`` (mid-save), ``durable`` (retention, gc, queueing promotion), ``promoted``
        (between promotions), ``promote_failed``..."""
        events = [e for e in self.events(pid) if e.get("event") not in ("step_time", "interval")]
        return str(events[-1].get("event")) if events else "start"

    def open(self) -> Any:
        deadline = time.monotonic() + 30
        while True:  # the gc loop holds the writer lock for a moment now and then
            try:
                return flashckpt.Checkpointer(
                    self.root, memory_tier=self.mem, keep=3, keep_memory=2
                )
            except flashckpt.LockedError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.02)

    def check_after_kill(self) -> None:
        count("checks.kill")
        ckpt = self.open()
        try:
            self.check_restores(ckpt)
            ckpt.wait_promoted(timeout_s=60)
        finally:
            ckpt.close()
        for d in (self.root, self.mem):
            if (d / "steps").is_dir():
                rc, text = self.cli("verify", str(d))
                if rc != 0:
                    self.fail("verify_after_kill", f"flashckpt verify {d} exited {rc}: {text}")
        for d in (self.root, self.mem):
            if (d / "steps").is_dir():
                self.gc_until_done(d)
        left = [f for f in temp_files(self.root, self.mem) if f not in self.temp_seen]
        if left:
            self.temp_seen.update(left)
            self.fail("temp_file_left", f"after a clean run and gc: {left[:3]} ({len(left)})")

    def check_restores(self, ckpt: Any) -> None:
        steps = ckpt.steps()
        if self.durable is not None and (not steps or steps[-1] < self.durable):
            self.fail("durable_lost", f"newest step {steps[-1:]} < reported durable {self.durable}")
        state = build()
        got = ckpt.restore(state)
        count("checks.restore")
        if steps and got != steps[-1]:
            self.fail("restore_not_newest", f"restore() gave {got}, steps are {steps}")
        if got is not None and not same(snapshot(state), expected(got)):
            self.fail("restore_wrong_data", f"restore() of step {got} differs from training")
        for s in steps:
            ckpt.wait_promoted(timeout_s=60)  # a restore queues promotion, then retention
            if s not in ckpt.steps():
                count("checks.retired_meanwhile")
                continue
            state = build()
            count("checks.restore")
            try:
                ckpt.restore(state, step=s)
            except flashckpt.FlashCkptError as exc:
                self.fail("retained_step_damaged", f"restore(step={s}) raised {exc}")
                continue
            if not same(snapshot(state), expected(s)):
                self.fail("restore_wrong_data", f"restore(step={s}) differs from training")

    def gc_until_done(self, d: Path) -> None:
        deadline = time.monotonic() + 30
        while True:  # exit 2 while the gc loop holds the lock: try again
            rc, text = self.cli("gc", str(d))
            if rc == 0 or time.monotonic() > deadline:
                break
            time.sleep(0.02)
        if rc != 0:
            self.fail("gc_refused_while_idle", f"flashckpt gc {d} exited {rc}: {text}")

    def cli(self, *args: str) -> tuple[int, str]:
        out = io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            rc = cli_main(list(args))
        return rc, out.getvalue()

    def check_reader(self) -> None:
        """Every damage the reader reported must be real: the step is still there, damaged."""
        self.stop_bg()
        runs = []
        for ln in _lines(self.base / "read.jsonl"):
            with contextlib.suppress(ValueError):  # the last line may be torn by the kill
                runs.append(json.loads(ln))
        count("reader.runs", len(runs))
        for r in runs:
            if r["rc"] == 99:
                self.fail("reader_crashed", f"the CLI itself raised: {r}")
            if r["rc"] == 3:
                self.fail("restore_wrong_data", f"the read-only restore: {r}")
            if r["cmd"] == "gc":
                continue
            for line in r.get("damaged", []):
                step = _step_of(line)
                d = Path(r["dir"])
                real = (
                    step is not None and step in disk_steps(d) and not inspect_step(d, step).intact
                )
                if not real:
                    count("reader.false_damage")
                    self.fail("false_damage", f"{r['cmd']} {d}: {line.strip()[:160]}")
                    return


def _step_of(line: str) -> int | None:
    words = line.replace(":", " ").split()
    for i, w in enumerate(words[:-1]):
        if w == "step" and words[i + 1].isdigit():
            return int(words[i + 1])
    first = words[0] if words else ""
    return int(first) if first.isdigit() else None
