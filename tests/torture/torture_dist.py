"""Seeded distributed torture (issue 27): two real gloo ranks on two simulated nodes.

One session = one seed = a sequence of *runs* of a 2-rank job with ``replicas=1``. Each rank is
a forked process with its own memory tier (``SHM/n0``, ``SHM/n1``: its node), the disk tier is
shared. A run restores, then saves a seeded number of steps, each step's tensors a function of
(run, step) only, so two runs' copies of one step number differ. A run may meet, seeded:

* a **slow peer**: one rank's replication rounds take longer than ``Replication.timeout_s``;
* a **kill after the manifest**: rank 0 SIGKILLs itself right after it published a step's
  manifest, before the save reports; or rank 1 right after writing its part;
* a **kill at a random instant** of either rank (SIGKILL from a timer);
* after a kill, a **node loss**: node 1's memory tier is deleted before the next run.

A rank whose save raises ends there (no close, like a job whose peer died). The next run's
restore is the check, against an oracle kept here (never the library's judge):

* every step reported saved ok on both ranks is restorable (no newer step lost): after a node
  loss, those whose safety the documented bound gives (a later save of the same run reported
  ok, or a clean close of every rank; docs/guides/safety.md "The bound");
* restore returns exactly the saved tensors of the step it reports, saved by the run whose copy
  is on the live branch (a run branches at the step it restored: copies above it are abandoned);
* a step every reporting rank called failed (an error other than ``OutcomeUnknownError``, no
  rank ok) is never restored; both ranks restore the same step.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import random
import shutil
import signal
import threading
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import xxhash
from torture_faults import count
from torture_oracle import Violation, ViolationError

RUNS_PER_SESSION = 4
TIMEOUT_S = 1.0  # Replication.timeout_s
DIST_TIMEOUT_S = 4.0
LAYERS = 4
SLOW_S = TIMEOUT_S + 0.8  # a slow replication round
SAFE_AFTER_S = TIMEOUT_S + SLOW_S + 1.0  # a round behind a slow one has failed by then


def repro(seed: int) -> str:
    return f"FLASHCKPT_TORTURE_SEED={seed} python -m pytest tests/torture/test_dist_sim.py -x"


# -- the state: a function of (run, step) ------------------------------------------------------
def build() -> torch.nn.Module:
    torch.manual_seed(12345)
    return torch.nn.Sequential(*[torch.nn.Linear(256, 300) for _ in range(LAYERS)])


def fill(model: torch.nn.Module, run: int, step: int) -> None:
    """Layer i changes every i+1 steps (later saves reuse chunks), always with the run mixed in."""
    with torch.no_grad():
        for i, layer in enumerate(model):
            g = torch.Generator().manual_seed(run * 1_000_003 + (step // (i + 1)) * 101 + i)
            layer.weight.copy_(torch.randn(layer.weight.shape, generator=g))
            layer.bias.fill_(float(run * 1000 + step // (i + 1)))


def digest(model: torch.nn.Module) -> str:
    h = xxhash.xxh3_128()
    for k, v in model.state_dict().items():
        h.update(k.encode())
        h.update(v.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def expected_digest(run: int, step: int) -> str:
    m = build()
    fill(m, run, step)
    return digest(m)


# -- one run's plan ----------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class RunPlan:
    run: int
    saves: int
    kill: str | None  # manifest (rank 0) / part (rank 1) / timer / None
    kill_at: int  # manifest, part: the index of the save; timer: unused
    kill_rank: int
    kill_delay_s: float
    slow_rank: int | None
    slow_rounds: list[int] = field(default_factory=list)  # replication rounds (1-based)
    kill_at_step: int = -1  # manifest, part: the step (set at launch from kill_at)
    pause_at: int = -1  # after this save, "train" long enough for the bound to pass

    @classmethod
    def draw(cls, rng: random.Random, run: int) -> RunPlan:
        saves = rng.randint(2, 6)
        kill = rng.choice(["manifest", "part", "timer", "timer", None])
        slow = rng.random() < 0.5
        return cls(
            run=run,
            saves=saves,
            kill=kill,
            kill_at=rng.randrange(saves),
            kill_rank={"manifest": 0, "part": 1}.get(kill or "", rng.randrange(2)),
            kill_delay_s=rng.uniform(0.0, 0.3 + 0.15 * saves),
            slow_rank=rng.randrange(2) if slow else None,
            slow_rounds=sorted(rng.sample(range(1, saves + 1), 1)) if slow else [],
            pause_at=rng.randrange(saves) if rng.random() < 0.5 else -1,
        )


# -- a rank ------------------------------------------------------------------------------------
def _hooks(rank: int, plan: RunPlan, say: Any) -> None:
    from flashckpt.distributed.replication import transfer
    from flashckpt.store.store import CheckpointStore

    rounds = {"n": 0}
    real_chunks = transfer.Exchange.chunks

    def chunks(self: Any, *a: Any, **k: Any) -> Any:
        rounds["n"] += 1
        if rank == plan.slow_rank and rounds["n"] in plan.slow_rounds:
            say(event="slow_round", round=rounds["n"])
            time.sleep(SLOW_S)  # longer than Replication.timeout_s
        return real_chunks(self, *a, **k)

    transfer.Exchange.chunks = chunks  # type: ignore[method-assign]
    if plan.kill not in ("manifest", "part") or rank != plan.kill_rank:
        return
    real_commit = CheckpointStore.commit

    def commit(self: Any, manifest: Any, *a: Any, **k: Any) -> Any:
        out = real_commit(self, manifest, *a, **k)
        part = ".rank-" in str(k.get("name") or "")
        if manifest.step == plan.kill_at_step and part == (plan.kill == "part"):
            say(event="killed", step=manifest.step, where=plan.kill)
            os.kill(os.getpid(), signal.SIGKILL)
        return out

    CheckpointStore.commit = commit  # type: ignore[method-assign]


def rank_main(rank: int, world: int, init: str, root: str, shm: str, doc: str, log: str) -> None:
    out = open(log, "a", buffering=1)  # noqa: SIM115 (until os._exit)

    def say(**kw: Any) -> None:
        out.write(json.dumps({"rank": rank, "t": time.monotonic(), **kw}) + "\n")

    try:
        import torch.distributed as dist

        import flashckpt
        from flashckpt.engine.options import Replication

        torch.set_num_threads(1)
        plan = RunPlan(**json.loads(doc))
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
        _hooks(rank, plan, say)
        ck = flashckpt.Checkpointer(
            root,
            memory_tier=f"{shm}/n{rank}",
            replicas=Replication(placement=lambda r: f"n{r}", timeout_s=TIMEOUT_S),
            fsync=False,
            async_save=False,
            dist_timeout_s=DIST_TIMEOUT_S,
            keep=3,
            keep_memory=3,
        )
        model = build()
        fill(model, -1, -1)
        try:
            got = ck.restore({"model": model})
        except Exception as exc:
            say(event="restore_error", type=type(exc).__name__, msg=str(exc)[:400])
            return
        say(event="restored", step=got, digest=digest(model) if got is not None else None)
        if plan.kill == "timer" and rank == plan.kill_rank:
            threading.Timer(plan.kill_delay_s, os.kill, (os.getpid(), signal.SIGKILL)).start()
        start = 0 if got is None else got + 1
        for i in range(plan.saves):
            step = start + i
            fill(model, plan.run, step)
            say(event="saving", step=step)
            try:
                ck.save(step, {"model": model}).durable.result()
            except Exception as exc:
                say(event="error", step=step, type=type(exc).__name__, msg=str(exc)[:400])
                return  # the job ends here: no close (a peer may be dead)
            say(event="ok", step=step)
            time.sleep(SAFE_AFTER_S + 0.3 if i == plan.pause_at else 0.05)  # "training"
        try:
            ck.close()
            say(event="closed")
        except Exception as exc:
            say(event="close_error", type=type(exc).__name__, msg=str(exc)[:400])
    except BaseException as exc:
        say(event="harness_error", type=type(exc).__name__, msg=str(exc)[:600])
    finally:
        out.flush()
        os._exit(0)


# -- the session -------------------------------------------------------------------------------
@dataclass
class Saved:
    run: int
    status: str  # ok / unknown / failed
    safe: bool  # survives a node loss (the documented bound)
    excused: bool = False  # ok but lost with its node, within the bound


@dataclass
class DistSession:
    base: Path
    seed: int
    runs: int = RUNS_PER_SESSION
    rng: random.Random = field(init=False)
    root: Path = field(init=False)
    shm: Path = field(init=False)
    saved: dict[int, Saved] = field(default_factory=dict)
    log: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.rng = random.Random(f"dist|{self.seed}")
        self.root = self.base / "root"
        shm = Path("/dev/shm")
        use = shm.is_dir() and os.access(shm, os.W_OK)
        self.shm = (shm if use else self.base) / f"flashckpt-dtort-{uuid.uuid4().hex[:10]}"

    def fail(self, invariant: str, detail: str) -> None:
        count(f"violation.{invariant}")
        tail = "\n  ".join(self.log[-14:])
        raise ViolationError(
            Violation(
                invariant,
                f"dist seed {self.seed}: {detail}\n  log:\n  {tail}\n  reproduce: "
                f"{repro(self.seed)}",
            )
        )

    def run(self) -> None:
        try:
            for r in range(self.runs):
                self.one_run(r, RunPlan.draw(self.rng, r))
            last = RunPlan(
                run=self.runs,
                saves=0,
                kill=None,
                kill_at=0,
                kill_rank=0,
                kill_delay_s=0.0,
                slow_rank=None,
            )
            self.one_run(self.runs, last)
        finally:
            shutil.rmtree(self.shm, ignore_errors=True)

    def one_run(self, r: int, plan: RunPlan) -> None:
        events = self.launch(r, plan)
        self.check_restore(r, events)
        killed = self.settle(r, plan, events)
        if killed and self.rng.random() < 0.35:
            shutil.rmtree(self.shm / "n1", ignore_errors=True)
            count("dist.node_losses")
            self.log.append("  node 1 lost (its memory tier deleted)")
            for s in self.saved.values():
                if s.status == "ok" and not s.safe:
                    s.excused = True

    def launch(self, r: int, plan: RunPlan) -> list[dict[str, Any]]:
        self.base.mkdir(parents=True, exist_ok=True)
        start = self.newest_branch_start()
        doc = {**asdict(plan), "kill_at_step": start + plan.kill_at}  # (aimed: see below)
        self.log.append(f"run {r}: {doc}")
        init = f"file://{self.base}/store-{uuid.uuid4().hex}"
        logs = [self.base / f"run{r}-rank{k}.jsonl" for k in range(2)]
        ctx = mp.get_context("fork")
        procs = [
            ctx.Process(
                target=rank_main,
                args=(k, 2, init, str(self.root), str(self.shm), json.dumps(doc), str(logs[k])),
            )
            for k in range(2)
        ]
        for p in procs:
            p.start()
        deadline = time.monotonic() + 180
        for p in procs:
            p.join(max(1.0, deadline - time.monotonic()))
        hung = [k for k, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(30)
        events = []
        for k, lg in enumerate(logs):
            for ln in lg.read_text().splitlines() if lg.exists() else []:
                try:
                    events.append(json.loads(ln))
                except ValueError:
                    continue  # a line torn by the kill
            events.append({"rank": k, "event": "exit", "code": procs[k].exitcode})
        for e in events:
            if e["event"] in ("harness_error", "close_error", "restore_error", "error"):
                self.log.append(f"  rank {e['rank']} {e['event']}: {e.get('type')} {e.get('msg')}")
        if hung:
            self.fail("dist_hang", f"run {r}: ranks {hung} still running after 180 s")
        bad = [e for e in events if e["event"] in ("harness_error", "restore_error")]
        if bad:
            self.fail(bad[0]["event"], f"run {r}: {bad[0]}")
        return events

    def newest_branch_start(self) -> int:
        """The step the next run will save first if it restores the newest step that may
        exist (only aims the kill points; the run saves from what it really restored)."""
        maybe = [s for s, v in self.saved.items() if v.status != "failed" and not v.excused]
        return max(maybe) + 1 if maybe else 0

    def check_restore(self, r: int, events: list[dict[str, Any]]) -> None:
        got = [e for e in events if e["event"] == "restored"]
        count("checks.dist_restore")
        if len(got) != 2:
            self.fail("dist_restore_missing", f"run {r}: restored reported by {len(got)} ranks")
        steps = {e["step"] for e in got}
        if len(steps) != 1:
            self.fail("dist_disagree", f"run {r}: the ranks restored {sorted(map(str, steps))}")
        p = got[0]["step"]
        floor = max(
            (s for s, v in self.saved.items() if v.status == "ok" and not v.excused), default=None
        )
        self.log.append(f"  restored {p} (newest durable {floor})")
        if floor is not None and (p is None or p < floor):
            self.fail("durable_lost", f"run {r}: restore() gave {p}, step {floor} was saved ok")
        if p is not None:
            v = self.saved.get(p)
            if v is None:
                self.fail("restore_unknown_step", f"run {r}: step {p} is not on the live branch")
            elif v.status == "failed":
                self.fail("failed_step_restored", f"run {r}: step {p} was reported failed")
            elif any(e["digest"] != expected_digest(v.run, p) for e in got):
                self.fail("restore_wrong_data", f"run {r}: step {p} is not run {v.run}'s bytes")
        for s in [s for s in self.saved if p is None or s > p]:
            del self.saved[s]  # abandoned: this run branched at p

    def settle(self, r: int, plan: RunPlan, events: list[dict[str, Any]]) -> bool:
        """Record each step this run attempted; True when a rank was killed."""
        by: dict[int, dict[int, dict[str, Any]]] = {}
        for e in events:
            if e["event"] in ("saving", "ok", "error"):
                by.setdefault(e["step"], {})
                if e["event"] != "saving" or e["rank"] not in by[e["step"]]:
                    by[e["step"]][e["rank"]] = e
        closed = sum(e["event"] == "closed" for e in events) == 2
        steps = sorted(by)
        for i, s in enumerate(steps):
            rep = by[s]
            oks = [k for k, e in rep.items() if e["event"] == "ok"]
            errs = [e for e in rep.values() if e["event"] == "error"]
            if len(oks) == 2:
                status = "ok"
            elif oks or any(e["type"] == "OutcomeUnknownError" for e in errs) or not errs:
                status = "unknown"
            else:
                status = "failed"
            # the bound: replicated within its round, or (the round failed) on disk by the next
            # save; a round may wait behind a slow one, so the next save must start after both
            ok_t = max((e["t"] for e in rep.values() if e["event"] == "ok"), default=0.0)
            later = [
                min(e["t"] for e in by[u].values())
                for u in steps[i + 1 :]
                if sum(e["event"] == "ok" for e in by[u].values()) == 2
            ]
            safe = closed or any(t >= ok_t + SAFE_AFTER_S for t in later)
            self.saved[s] = Saved(run=r, status=status, safe=safe)
            count(f"dist.saves.{status}")
        killed = any(e["event"] == "exit" and e["code"] == -signal.SIGKILL for e in events)
        if killed:
            count("kills")
            count(f"dist.kills.{plan.kill}")
        count("dist.runs")
        count("dist.slow_rounds", sum(e["event"] == "slow_round" for e in events))
        return killed
