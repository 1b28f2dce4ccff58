"""Seeded random operation sequences through the public API, checked against the oracle.

One trial = one seed: a configuration (sync/async, memory tier or not, retention, fsync,
incremental on/off) and a sequence of operations — save, restore, restore(step=), close,
re-open, simulated crash (the process's I/O stops at a random call, then it is abandoned),
``flashckpt gc`` / ``verify`` / ``ls`` (the CLI, in process), a vanishing directory, a rotted
chunk, a chunk damaged in place at its size (``inplace``: later steps must not reuse it), a
``requeue`` onto another node or back onto one where an earlier attempt died, a
``kill_after_manifest`` (torture_nodes.py) — each run with a seeded fault mix (or none) and
followed by the oracle's checks. Each simulated process has a real pid of its own
(torture_procs.py).
"""

from __future__ import annotations

import contextlib
import random
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torture_checks import N_FROZEN, N_W, Checks
from torture_cliops import CliOps
from torture_faults import KINDS, FaultPlan, count, damage_in_place, flip_bit
from torture_known import record_hit, tolerated
from torture_nodes import NodeOps, run_generation
from torture_oracle import (
    Violation,
    ViolationError,
    disk_steps,
)
from torture_procs import simulated_pids

import flashckpt
from flashckpt.engine.tiers.promote import Promotion

OPS_PER_TRIAL = 40


def repro(seed: int) -> str:
    return f"FLASHCKPT_TORTURE_SEED={seed} python -m pytest tests/torture/test_sim.py -k sim -x"


@dataclass(frozen=True, kw_only=True)
class SimConfig:
    async_save: bool
    memory: bool
    incremental: bool
    keep: int
    keep_memory: int
    fsync: bool
    workers: int
    promote_every: int  # Promotion(every=): some steps never leave the memory tier

    @classmethod
    def from_seed(cls, seed: int) -> SimConfig:
        r = random.Random(f"config|{seed}")
        return cls(
            async_save=r.random() < 0.5,
            memory=r.random() < 0.6,
            incremental=r.random() < 0.85,
            keep=r.choice((1, 2, 3)),
            keep_memory=r.choice((1, 2)),
            fsync=r.random() < 0.3,
            workers=r.choice((1, 2)),
            promote_every=r.choice((1, 1, 2, 3)),
        )


@dataclass
class Pending:
    step: int
    handle: Any
    op: int
    gen: int | None = None  # the run generation that saved it


@dataclass
class Sim(NodeOps, CliOps, Checks):
    base: Path
    seed: int
    plan: FaultPlan
    ops: int = OPS_PER_TRIAL
    faults: bool = True  # False: no injected faults (the harness's own self-tests)
    cfg: SimConfig = field(init=False)
    rng: random.Random = field(init=False)
    root: Path = field(init=False)
    mem: Path | None = field(init=False)  # the memory tier of the node the run is on
    nodes: list[Path] = field(init=False)  # every node's memory tier (requeue: torture_nodes)
    ckpt: Any = None
    run_gen: int | None = None  # the open Checkpointer's run generation (ROOT/generation)
    pids: Any = None  # torture_procs.SimPids: a real pid per simulated process
    state: dict[str, Any] = field(default_factory=dict)
    records: dict[int, dict[int | None, dict[str, Any]]] = field(default_factory=dict)
    outcome: dict[tuple[int, int | None], str] = field(default_factory=dict)
    committed: dict[str, dict[int, int]] = field(default_factory=dict)  # tier -> step -> op
    pending: list[Pending] = field(default_factory=list)
    delivered: list[BaseException] = field(default_factory=list)  # errors we have observed
    next_step: int = 0
    op: int = 0
    log: list[str] = field(default_factory=list)
    known: list[Violation] = field(default_factory=list)
    temp_seen: set[str] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.cfg = SimConfig.from_seed(self.seed)
        self.rng = random.Random(self.seed)
        self.root = self.base / "root"
        self.nodes = [self.base / f"node{i}-mem" for i in range(2)] if self.cfg.memory else []
        self.mem = self.nodes[0] if self.nodes else None
        g = torch.Generator().manual_seed(self.seed)
        self.state = {
            "w": torch.randn(N_W, generator=g),
            "frozen": torch.randn(N_FROZEN, generator=g),
            "b": {f"b{i}": torch.randn(8, generator=g) for i in range(24)},
            "meta": {"step": -1, "tag": "start"},
        }

    # -- plumbing ---------------------------------------------------------------------------
    @property
    def tiers(self) -> list[tuple[str, Path, int]]:
        out = []
        if self.mem is not None:
            out.append(("memory", self.mem, self.cfg.keep_memory))
        out.append(("local", self.root, self.cfg.keep))
        return out

    def fail(self, invariant: str, detail: str, *, fatal: bool = False) -> None:
        """Raise a violation; one of a known bug (torture_known.py) is recorded and the trial
        goes on (the caller absorbs it into the oracle), or ends when ``fatal``."""
        v = Violation(invariant, f"seed {self.seed} op {self.op}: {detail}")
        count(f"violation.{invariant}")
        if tolerated(invariant):
            self.known.append(v)
            record_hit(v, "; ".join(self.log[-6:]))
            if fatal:
                raise _KnownBug(v)
            return
        tail = "\n  ".join(self.log[-12:])
        raise ViolationError(
            Violation(
                invariant,
                f"{v.detail}\n  config {self.cfg}\n  last ops:\n  {tail}\n"
                f"  reproduce: {repro(self.seed)}",
            )
        )

    def open(self) -> Any:
        ckpt = flashckpt.Checkpointer(
            self.root,
            async_save=self.cfg.async_save,
            incremental=self.cfg.incremental,
            keep=self.cfg.keep,
            chunk_size="16KiB",
            host_memory_budget="4MiB",
            persist_workers=self.cfg.workers,
            fsync=self.cfg.fsync,
            direct_io=False,
            memory_tier=self.mem,
            keep_memory=self.cfg.keep_memory if self.mem is not None else None,
            keep_memory_after_close=True,  # the oracle expects each tier's retention only
            promotion=Promotion(
                retries=2,
                workers=2,
                backoff_s=0.0,
                max_backoff_s=0.0,
                every=self.cfg.promote_every,
            ),
        )
        self.run_gen = run_generation(self.root)
        return ckpt

    def fault_mix(self) -> dict[str, float]:
        r = self.rng.random()
        if r < 0.4 or not self.faults:
            return {}
        kinds = self.rng.sample(KINDS, self.rng.choice((1, 1, 2, 3)))
        return {k: self.rng.choice((0.03, 0.1, 0.3)) for k in kinds}

    # -- the run ----------------------------------------------------------------------------
    def run(self) -> None:
        with simulated_pids(self.plan) as self.pids:
            self.pids.start(self.plan.generation)
            try:
                for i in range(self.ops):
                    self.op = i
                    self.step_once()
            except _KnownBug:
                pass
            finally:
                self.plan.begin_op(self.op + 1, {})
                self.shutdown()

    def next_process(self) -> None:
        """Whatever runs next is another process: a new generation of backends, its own pid
        (when the trial runs under torture_procs.simulated_pids, as run() does)."""
        if self.pids is not None:
            self.pids.end(self.plan.generation)
        self.plan.generation += 1
        if self.pids is not None:
            self.pids.start(self.plan.generation)

    def step_once(self) -> None:
        name, fn = self.choose()
        rates = self.fault_mix() if name not in ("vanish", "rot", "inplace") else {}
        if name == "requeue" and self.rng.random() < 0.5:
            rates = {}  # half the requeues restore without faults: the lineage checks are exact
        self.log.append(f"op {self.op}: {name} faults={rates or 'none'}")
        self.plan.begin_op(self.op, rates)
        count("ops")
        count(f"op.{name}")
        try:
            skip_check = fn(clean=not rates)
        finally:
            self.plan.begin_op(self.op, {})
        if not skip_check:
            self.check()

    def choose(self) -> tuple[str, Callable[..., bool | None]]:
        if self.ckpt is None:
            table: list[tuple[str, float, Callable[..., bool | None]]] = [
                ("reopen", 6, self.op_reopen),
                ("gc", 1, self.op_gc),
                ("verify", 0.7, self.op_verify),
                ("ls", 0.5, self.op_ls),
                ("vanish", 0.3, self.op_vanish),
                ("rot", 0.3, self.op_rot),
                ("inplace", 0.4, self.op_inplace),
                ("requeue", 1.5 if self.nodes else 0, self.op_requeue),
            ]
        else:
            table = [
                ("save", 8, self.op_save),
                ("restore", 2, self.op_restore),
                ("restore_step", 1, self.op_restore_step),
                ("close", 1, self.op_close),
                ("crash", 0.8, self.op_crash),
                ("gc", 0.6, self.op_gc),
                ("verify", 0.5, self.op_verify),
                ("ls", 0.4, self.op_ls),
                ("vanish", 0.25, self.op_vanish),
                ("rot", 0.3, self.op_rot),
                ("inplace", 0.5, self.op_inplace),
                ("requeue", 1.0 if self.nodes else 0, self.op_requeue),
                ("kill_after_manifest", 0.6, self.op_kill_after_manifest),
            ]
        if not self.faults:  # no harness-made damage either
            table = [t for t in table if t[0] not in ("vanish", "rot", "inplace")]
        pick = self.rng.choices(table, weights=[w for _, w, _ in table])[0]
        return pick[0], pick[2]

    # -- operations ---------------------------------------------------------------------------
    def mutate(self, step: int) -> None:
        w = self.state["w"]
        for _ in range(self.rng.randint(0, 2)):
            c = self.rng.randrange(4)
            w[c * 4096 : (c + 1) * 4096] += 1.0
        if self.rng.random() < 0.5:
            self.state["b"][f"b{self.rng.randrange(24)}"] += 1.0
        # the run's own mark (requeue: two runs' copies of one step number must differ)
        w[0] = float(self.run_gen or 0)
        self.state["meta"] = {"step": step, "tag": f"t{self.rng.randrange(1000)}"}
        self.state["meta"]["run"] = self.run_gen

    def snapshot(self) -> dict[str, Any]:
        s = self.state
        return {
            "w": s["w"].clone(),
            "frozen": s["frozen"].clone(),
            "b": {k: v.clone() for k, v in s["b"].items()},
            "meta": dict(s["meta"]),
        }

    def op_save(self, clean: bool) -> bool:
        step = self.next_step
        self.next_step += self.rng.randint(1, 3)
        self.mutate(step)
        if any(g != self.run_gen for g in self.records.get(step, {})):
            count("sim.step_saved_again_by_another_run")
        self.records.setdefault(step, {})[self.run_gen] = self.snapshot()
        try:
            handle = self.ckpt.save(step, self.state)
        except flashckpt.FlashCkptError as exc:
            self.outcome[(step, self.run_gen)] = "failed"
            self.check_stale_error(exc)
            return False
        except Exception as exc:
            self.fail("non_flashckpt_error", f"save({step}) raised {type(exc).__name__}: {exc}")
        self.pending.append(Pending(step=step, handle=handle, op=self.op, gen=self.run_gen))
        # an async save may stay in flight during the next operation
        return self.cfg.async_save and self.rng.random() < 0.4

    def check_stale_error(self, exc: BaseException) -> None:
        if any(exc is old or exc.__cause__ is old for old in self.delivered):
            self.fail("error_delivered_twice", f"save() raised an error already delivered: {exc}")

    def op_restore(self, clean: bool) -> None:
        with self.plan.off():  # restore() waits for the save in flight first anyway
            self.quiesce()
        self.check_restore_newest(clean=clean)

    def op_restore_step(self, clean: bool) -> None:
        with self.plan.off():
            self.quiesce()
        present = sorted({s for _, d, _ in self.tiers for s in disk_steps(d)})
        if present:
            self.check_restore_step(self.rng.choice(present), clean=clean)

    def op_close(self, clean: bool) -> None:
        ckpt, self.ckpt = self.ckpt, None
        try:
            ckpt.close()
        except flashckpt.FlashCkptError:
            pass
        except Exception as exc:
            self.fail("non_flashckpt_error", f"close() raised {type(exc).__name__}: {exc}")
        self.resolve_pending(crashed=False)

    def op_crash(self, clean: bool) -> None:
        """The process dies at a random backend call from now on; its remains are abandoned
        (closing the dead object only releases its locks: every I/O of it fails)."""
        gen = self.plan.generation
        self.plan.kill(gen, after=self.rng.randint(0, 30))
        for p in self.pending:
            with contextlib.suppress(BaseException):
                p.handle.durable.exception(timeout=60)
        self.plan.kill(gen, after=0)
        self.next_process()  # whatever runs next is another process
        self.resolve_pending(crashed=True)
        ckpt, self.ckpt = self.ckpt, None
        with contextlib.suppress(BaseException):
            ckpt.close()
        forget_process_memory()  # the next "process" starts without the dead one's Liveness
        count("sim.crashes")

    def op_reopen(self, clean: bool) -> None:
        self.next_process()
        try:
            self.ckpt = self.open()
        except flashckpt.LockedError as exc:
            if clean:
                self.fail("lock_leaked", f"Checkpointer() refused: {exc}", fatal=True)
        except flashckpt.FlashCkptError:
            pass
        except Exception as exc:
            self.fail("non_flashckpt_error", f"Checkpointer() raised {type(exc).__name__}: {exc}")

    def op_vanish(self, clean: bool) -> None:
        self.quiesce()
        name, d, _ = self.rng.choice(self.tiers)
        if name == "memory" and self.rng.random() < 0.25 and d.exists():
            shutil.rmtree(d)
            self.committed[str(d)] = {}
            self.plan.taint("vanish", d, "")
            self.log.append(f"  removed the memory tier {d}")
            return
        subs = sorted((d / "chunks").glob("*")) if (d / "chunks").is_dir() else []
        if not subs:
            return
        sub = self.rng.choice(subs)
        for f in sorted(sub.iterdir()):
            self.plan.taint("vanish", d, f"chunks/{sub.name}/{f.name}")
        shutil.rmtree(sub)
        self.log.append(f"  removed {sub}")

    def op_rot(self, clean: bool) -> None:
        self.quiesce()
        _, d, _ = self.rng.choice(self.tiers)
        files = sorted(p for p in (d / "chunks").glob("*/*") if p.is_file())
        if not files:
            return
        f = self.rng.choice(files)
        flip_bit(f, self.rng)
        self.plan.taint("rot", d, str(f.relative_to(d)))
        self.log.append(f"  rotted {f.relative_to(d)}")

    def op_inplace(self, clean: bool) -> None:
        """Damage a random stored chunk in place, its size kept (issue 27). The oracle excuses
        the steps committed before this op only: a step committed later must not name the
        damaged bytes (the library rewrites the chunk instead of reusing it)."""
        self.quiesce()
        _, d, _ = self.rng.choice(self.tiers)
        files = sorted(
            p for p in (d / "chunks").glob("*/*") if p.is_file() and ".tmp-" not in p.name
        )
        if not files:
            return
        f = self.rng.choice(files)
        what = damage_in_place(f, self.rng)
        self.plan.taint("inplace", d, str(f.relative_to(d)))
        self.log.append(f"  {what} in {f.relative_to(d)}")
        count("sim.inplace")

    def shutdown(self) -> None:
        ckpt, self.ckpt = self.ckpt, None
        if ckpt is not None:
            with contextlib.suppress(BaseException):
                ckpt.close()


class _KnownBug(Exception):
    def __init__(self, v: Violation) -> None:
        super().__init__(v.detail)
        self.violation = v


def forget_process_memory() -> None:
    """What a real crash takes with it: the in-memory chunk-liveness state of every root (one
    per root per process, shared by every store on it). Without this, the simulated next
    process would do its I/O through the dead one's backend."""
    from flashckpt.store import liveness

    with liveness._registry_lock:
        liveness._registry.clear()
