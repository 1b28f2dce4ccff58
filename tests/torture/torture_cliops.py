"""The simulation's CLI operations, mixed into torture_sim.Sim: ``flashckpt gc`` / ``verify`` /
``ls`` run in process, as another process would run them, each checked against the ground truth
on disk (torture_oracle)."""

from __future__ import annotations

import contextlib
import io
import threading
from pathlib import Path
from typing import Any

from torture_faults import count
from torture_oracle import disk_steps, inspect_step

from flashckpt.cli import main as cli_main


class CliOps:
    """Needs from the simulation: ``ckpt``, ``plan``, ``op``, ``rng``, ``root``, ``tiers``,
    ``log``, ``fail``, ``quiesce`` and ``op_close``."""

    ckpt: Any
    plan: Any
    op: int
    rng: Any
    root: Path
    tiers: Any
    log: list[str]
    fail: Any

    def cli(self, *args: str) -> tuple[int, str]:
        """``flashckpt ARGS`` in this process, as another process would run it. Run on a
        thread: if it waits for the open Checkpointer (a gc that waits for the root's
        writers), that writer is closed so it can go on."""
        out = io.StringIO()
        result: dict[str, Any] = {}

        def run() -> None:
            try:
                with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
                    result["rc"] = cli_main(list(args))
            except Exception as exc:
                result["exc"] = exc

        gen, self.plan.generation = self.plan.generation, -1 - self.op  # its own process
        try:
            thread = threading.Thread(target=run, name="torture-cli", daemon=True)
            thread.start()
            thread.join(10)
            if thread.is_alive() and self.ckpt is not None:
                count("cli.waited_for_writer")
                self.log.append(f"  flashckpt {args[0]} waits for the open Checkpointer: close it")
                self.op_close(clean=True)
            thread.join(120)
        finally:
            self.plan.generation = gen
        if thread.is_alive():
            self.fail("cli_hang", f"flashckpt {args} still running after 130 s", fatal=True)
        if "exc" in result:
            exc = result["exc"]
            self.fail("non_flashckpt_error", f"flashckpt {args} raised {exc!r}", fatal=True)
        return int(result.get("rc", 2)), out.getvalue()

    def op_gc(self, clean: bool) -> None:
        tiers = [d for _, d, _ in self.tiers if (d / "steps").is_dir()]
        if not tiers:
            return
        target = self.rng.choice(tiers)
        rc, text = self.cli("gc", str(target))
        count("cli.gc")
        if rc not in (0, 2):
            self.fail("cli_exit", f"flashckpt gc {target} exited {rc}: {text}")
        if clean and self.ckpt is None and rc != 0 and not self.unreadable_manifest(target):
            self.fail("gc_refused_while_idle", f"flashckpt gc {target} exited {rc}: {text}")

    def unreadable_manifest(self, tier: Path) -> bool:
        """A torn manifest (left by a torn write) makes a fail-closed gc refuse: allowed."""
        with self.plan.off():
            return any(not inspect_step(tier, s).manifest_ok for s in disk_steps(tier))

    def op_verify(self, clean: bool) -> None:
        if not (self.root / "steps").is_dir():
            return
        self.quiesce()
        with self.plan.off():  # verify reads every tier a restore reads (issue 27)
            truths = [inspect_step(d, s) for _, d, _ in self.tiers for s in disk_steps(d)]
        rc, text = self.cli("verify", str(self.root))
        count("cli.verify")
        damaged = [t.step for t in truths if not t.intact]
        if rc == 0 and damaged:
            self.fail("verify_missed_damage", f"verify said ok; damaged steps {damaged}")
        if clean and rc == 1 and not damaged:
            self.fail("false_damage", f"verify reported damage, every step is intact: {text}")
        if rc not in (0, 1, 2) or (clean and rc == 2 and truths):
            self.fail("cli_exit", f"flashckpt verify exited {rc}: {text}")

    def op_ls(self, clean: bool) -> None:
        if not (self.root / "steps").is_dir() and not (self.root / "tiers.json").exists():
            return
        self.quiesce()
        rc, text = self.cli("ls", str(self.root))
        count("cli.ls")
        if rc not in (0, 2) or (clean and rc != 0):
            self.fail("cli_exit", f"flashckpt ls exited {rc}: {text}")
        if not clean:
            return
        with self.plan.off():
            for line in text.splitlines():
                if "DAMAGED" not in line:
                    continue
                step = int(line.split()[0])
                tiers = [d for _, d, _ in self.tiers if step in disk_steps(d)]
                if tiers and inspect_step(tiers[0], step).manifest_ok:
                    self.fail("false_damage", f"ls says step {step} is damaged: {line}")
