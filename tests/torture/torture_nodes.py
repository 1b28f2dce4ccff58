"""The simulation's nodes and its precise kill point (issue 27), mixed into torture_sim.Sim.

**Nodes.** A trial with a memory tier has two nodes, each with its own memory-tier directory
(the same root on a shared disk). ``requeue`` is what SLURM or Kubernetes does to a job whose
attempt died: the run ends (its process dies at a random backend call, or had already ended),
and the next attempt starts on a node the scheduler picks, often one where an earlier attempt
died and left its memory tier behind. That attempt restores (checked like every restore) and
saves again the step numbers after the step it restored. Every run mixes its generation into
the tensors it saves, so two runs' copies of one step number differ: restoring run 1's
abandoned copy of step N instead of run 2's durable step N is a wrong restore to the oracle,
which judges lineage itself (torture_oracle.lineage_live, over the copies this node can see).

**Kill after the manifest.** ``kill_after_manifest`` saves a step and kills the process right
after that save's manifest is published (in the tier the save lands in, or in the disk tier by
the promotion that follows), before ``save()`` or its future reports. The step's outcome is
unknown: it may be restored, then bitwise as saved, and no older durable step may be lost (the
usual checks, with the outcome ``unknown``).
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any

from torture_faults import count


def run_generation(root: Path) -> int | None:
    """The generation the writer that just opened ``root`` took (``ROOT/generation``, read
    plainly: the oracle never asks the library)."""
    try:
        doc = json.loads((root / "generation").read_bytes())
    except (OSError, ValueError):
        return None
    gen = doc.get("generation") if isinstance(doc, dict) else None
    return gen if isinstance(gen, int) else None


class NodeOps:
    """Needs from the simulation: ``ckpt``, ``plan``, ``rng``, ``mem``, ``nodes``, ``root``,
    ``pending``, ``outcome``, ``next_step``, ``run_gen``, ``log``, ``tiers`` and its ops."""

    ckpt: Any
    plan: Any
    rng: Any
    mem: Path | None
    nodes: list[Path]
    root: Path
    pending: list[Any]
    outcome: dict[tuple[int, int | None], str]
    next_step: int
    run_gen: int | None
    log: list[str]
    tiers: Any

    def op_requeue(self, clean: bool) -> None:
        died: list[Path] = self.__dict__.setdefault("died_on", [])
        if self.ckpt is not None:  # the attempt dies (at a random backend call from now on)
            assert self.mem is not None
            died.append(self.mem)
            self.op_crash(clean)  # type: ignore[attr-defined]
        self.requeue_onto(self.pick_node(died), clean=clean)

    def requeue_onto(self, node: Path, *, clean: bool) -> None:
        """The next attempt starts on ``node``, restores, and saves the steps after that one."""
        died: list[Path] = self.__dict__.setdefault("died_on", [])
        self.mem = node
        self.log.append(f"  requeued onto {node.name} (earlier attempts died on {len(died)})")
        count("sim.requeues")
        if died and node == died[-1]:
            count("sim.requeues.same_node")
        elif node in died:
            count("sim.requeues.old_node")  # where an attempt before the last one died
        self.op_reopen(clean)  # type: ignore[attr-defined]
        if self.ckpt is None:
            return
        with self.plan.off():
            self.quiesce()  # type: ignore[attr-defined]
        got = self.check_restore_newest(clean=clean)  # type: ignore[attr-defined]
        if got is not False:  # False: restore raised, the job goes on (the step numbers too)
            self.next_step = 0 if got is None else got + 1
            self.log.append(f"  restored {got}; saves step {self.next_step} next")

    def pick_node(self, died: list[Path]) -> Path:
        """Another node (the attempt after a death usually lands elsewhere), back on a node an
        earlier attempt died on (the case lineage is for), or any."""
        r = self.rng.random()
        others = [n for n in self.nodes if n != self.mem]
        older = [n for n in died[:-1] if n != self.mem]
        if r < 0.45 and others:
            return self.rng.choice(others)
        if r < 0.8 and older:
            return self.rng.choice(older)
        return self.rng.choice(self.nodes)

    def op_kill_after_manifest(self, clean: bool) -> None:
        gen = self.plan.generation
        to_disk = self.mem is not None and self.rng.random() < 0.3
        tier = self.root if to_disk else self.tiers[0][1]
        self.plan.kill_after_manifest(gen, tier)
        step, run = self.next_step, self.run_gen
        self.op_save(clean)  # type: ignore[attr-defined]
        for p in self.pending:
            with contextlib.suppress(BaseException):
                p.handle.durable.exception(timeout=60)
        if to_disk and self.ckpt is not None:
            with contextlib.suppress(BaseException):
                self.ckpt.wait_promoted(timeout_s=60)  # the promotion's manifest, then death
        self.plan.kill(gen, after=0)
        if self.outcome.get((step, run)) == "failed":
            self.outcome[(step, run)] = "unknown"  # it failed because its process died
        self.next_process()  # type: ignore[attr-defined]
        self.resolve_pending(crashed=True)  # type: ignore[attr-defined]
        ckpt, self.ckpt = self.ckpt, None
        with contextlib.suppress(BaseException):
            ckpt.close()
        from torture_sim import forget_process_memory

        forget_process_memory()
        count("sim.crashes")
        self.log.append(f"  killed after the manifest of step {step} in {tier.name}")
