"""The oracle's checks, run by the simulation after every operation (see torture_sim.py).

:class:`Checks` is mixed into :class:`torture_sim.Sim`: it settles the outcome of every save
(``durable`` succeeded, failed, or unknown after a crash), waits until nothing is in flight,
then compares the ground truth on disk and what ``restore()`` returns with what the API
promised (the invariants are listed in torture_oracle.py).
"""

from __future__ import annotations

import contextlib
import random
from pathlib import Path
from typing import Any

import torch
from torture_faults import count
from torture_oracle import (
    copy_lineage,
    disk_steps,
    excused,
    inspect_step,
    lineage_live,
    manifest_path,
    temp_files,
)

import flashckpt

N_W = 16384  # 64 KiB of float32: 4 chunks of 16 KiB
N_FROZEN = 8192


class Checks:
    """Needs from the simulation: ``ckpt``, ``plan``, ``tiers``, ``records``, ``outcome``,
    ``committed``, ``pending``, ``delivered``, ``temp_seen``, ``seed``, ``op``, ``fail``."""

    ckpt: Any
    plan: Any
    records: dict[int, dict[int | None, dict[str, Any]]]  # step -> generation -> saved state
    outcome: dict[tuple[int, int | None], str]  # (step, generation) -> ok / failed / unknown
    committed: dict[str, dict[int, int]]
    pending: list[Any]
    delivered: list[BaseException]
    temp_seen: set[str]
    seed: int
    op: int
    rng: random.Random
    tiers: Any
    fail: Any

    # -- outcomes and checks ----------------------------------------------------------------
    def resolve_pending(self, *, crashed: bool) -> None:
        for p in self.pending:
            try:
                exc = p.handle.durable.exception(timeout=120)
            except TimeoutError:
                self.fail("save_hang", f"step {p.step} neither durable nor failed after 120 s")
            key = (p.step, p.gen)
            if exc is None:
                self.outcome[key] = "ok"
                save_tier = self.tiers[0][1]
                self.committed.setdefault(str(save_tier), {}).setdefault(p.step, self.op)
            elif crashed:
                self.outcome[key] = "unknown"
            else:
                self.outcome[key] = "failed"
                # the error is now delivered, through the future or through handle.wait()
                r = random.Random(f"{self.seed}|{p.step}|observe")  # not self.rng: outcomes vary
                observe = p.handle.durable.result if r.random() < 0.5 else p.handle.wait
                with contextlib.suppress(BaseException):
                    observe()
                self.delivered.append(exc)
        self.pending.clear()

    def quiesce(self) -> None:
        self.resolve_pending(crashed=False)
        if self.ckpt is not None:
            with self.plan.off():
                if not self.ckpt.wait_promoted(timeout_s=120):
                    self.fail("promotion_hang", "promotions still pending after 120 s")

    def check(self) -> None:
        self.quiesce()
        count("checks")
        with self.plan.off():
            self.check_disk()
            if self.ckpt is not None and self.rng.random() < 0.3:
                self.check_restore_newest(clean=True)
                # a step restored from the memory tier alone is promoted, then retention runs
                # on the slower tier: done before the steps it keeps are restored one by one
                self.quiesce()
            if self.ckpt is not None and self.rng.random() < 0.15:
                for _, d, keep in self.tiers:
                    for s in sorted(self.committed.get(str(d), {}))[-keep:]:
                        self.quiesce()  # (the restore before may have promoted its step)
                        self.check_restore_step(s, clean=True)

    def check_disk(self) -> None:
        taints = self.plan.taints
        for (step, gen), out in list(self.outcome.items()):
            if out != "failed":
                continue
            for _, d, _ in self.tiers:
                if step in disk_steps(d):
                    lin = copy_lineage(d, step)
                    if lin is not None and lin[0] != gen:
                        continue  # another run's copy of the same step number (requeue)
                    torn = any(t.path == manifest_path(step) for t in taints)
                    if inspect_step(d, step).manifest_ok or not torn:
                        self.fail("failed_save_left_manifest", f"failed step {step} is in {d}")
                        self.outcome[(step, gen)] = "unknown"  # (known bug) may be restored
        for _, d, keep in self.tiers:
            seen = self.committed.setdefault(str(d), {})
            gens = self.__dict__.setdefault("copy_gens", {})
            for s in disk_steps(d):
                lin = copy_lineage(d, s)
                g = lin[0] if lin is not None else None
                if g is not None and gens.get((str(d), s), g) != g:
                    seen.pop(s, None)  # another run's copy replaced it: committed anew
                gens[(str(d), s)] = g
                whose = [g] if g is not None else list(self.records.get(s, {}))
                if any(self.outcome.get((s, x)) in ("ok", "unknown") for x in whose):
                    seen.setdefault(s, self.op)
            # the retention window counts every manifest the library lists (a torn one too)
            window = sorted(set(seen) | set(disk_steps(d)))[-keep:]
            damaged_seen = self.__dict__.setdefault("damaged_seen", set())
            for s in (x for x in window if x in seen):
                truth = inspect_step(d, s)
                if excused(truth, d, seen[s], taints):
                    if truth.present and not (truth.intact and truth.manifest_ok):
                        damaged_seen.add((str(d), s))
                    continue
                if not truth.present and (str(d), s) in damaged_seen:
                    continue  # damage the harness caused: a later save may replace the step
                if not truth.present and (str(d), s) not in self.live_copies():
                    continue  # abandoned: a restore removed it (it still counted for retention)
                elif not truth.present:
                    self.fail(
                        "retained_step_missing",
                        f"step {s} is gone from {d} (window {window}, there {disk_steps(d)})",
                    )
                    seen.pop(s)  # (known bug) forget it
                elif not truth.intact:
                    self.fail("retained_step_damaged", f"step {s} in {d}: {truth.bad_chunks}")
                    for rel in truth.bad_chunks:  # (known bug) from now on, expected damage
                        self.plan.taint("known", d, rel)
                    if not truth.manifest_ok:
                        self.plan.taint("known", d, manifest_path(s))
        left = [
            f
            for f in temp_files(*(d for _, d, _ in self.tiers if d.exists()))
            if f not in self.temp_seen
        ]
        if left:
            self.temp_seen.update(left)
            self.fail("temp_file_left", f"temporary files after quiescence: {left[:4]}")

    def live_copies(self) -> set[tuple[str, int]]:
        """The copies lineage makes the checkpoint (torture_oracle.lineage_live), judged with
        every copy present and every copy seen before (a restore removes abandoned ones)."""
        seen = self.__dict__.setdefault("lineage_seen", {})
        visible = {str(d) for _, d, _ in self.tiers}  # this node's memory tier and the disk
        for _, d, _ in self.tiers:
            for s in disk_steps(d):
                seen[(str(d), s)] = copy_lineage(d, s)  # (a step number saved again: anew)
        return lineage_live({k: v for k, v in seen.items() if k[0] in visible})

    def wanted(self, step: int, live: set[tuple[str, int]]) -> list[dict[str, Any]]:
        """What a restore of ``step`` may load: the state saved by the generation whose copy
        lineage makes the checkpoint (run 1's abandoned copy of a step that run 2 saved again
        is a wrong restore); any generation's when no live copy's lineage can be read."""
        saved = self.records.get(step, {})
        gens = set()
        for d, s in live:
            lin = copy_lineage(Path(d), s) if s == step else None
            if lin is not None:
                gens.add(lin[0])
        return [saved[g] for g in gens if g in saved] if gens else list(saved.values())

    def valid_copy(self, d: Any, step: int, live: set[tuple[str, int]]) -> bool:
        return (str(d), step) in live and inspect_step(d, step).intact

    def newest_valid(self) -> tuple[int | None, list[int]]:
        present = sorted({s for _, d, _ in self.tiers for s in disk_steps(d)})
        live = self.live_copies()
        for s in reversed(present):
            if any(self.valid_copy(d, s, live) for _, d, _ in self.tiers):
                return s, present
        return None, present

    def target(self) -> dict[str, Any]:
        return {
            "w": torch.full((N_W,), -7.0),
            "frozen": torch.full((N_FROZEN,), -7.0),
            "b": {f"b{i}": torch.full((8,), -7.0) for i in range(24)},
            "meta": {"step": -7},
        }

    def same(self, got: dict[str, Any], want: dict[str, Any]) -> bool:
        return (
            torch.equal(got["w"], want["w"])
            and torch.equal(got["frozen"], want["frozen"])
            and set(got["b"]) == set(want["b"])
            and all(torch.equal(got["b"][k], want["b"][k]) for k in want["b"])
            and got["meta"] == want["meta"]
        )

    def check_restore_newest(self, *, clean: bool) -> int | bool | None:
        """The step restore() returned (None: nothing; False: it raised), checked."""
        with self.plan.off():
            expect, _ = self.newest_valid()
            live = self.live_copies()
            wants = {s: self.wanted(s, live) for s in self.records}
            if any((str(d), s) not in live for _, d, _ in self.tiers for s in disk_steps(d)):
                count("checks.restore_beside_abandoned_copy")  # lineage must skip one
        tgt = self.target()
        count("checks.restore")
        try:
            got = self.ckpt.restore(tgt)
        except flashckpt.FlashCkptError as exc:
            if clean and expect is not None:
                self.fail(
                    "restore_raised", f"restore() raised though step {expect} is valid: {exc}"
                )
            return False
        except Exception as exc:
            self.fail("non_flashckpt_error", f"restore() raised {type(exc).__name__}: {exc}")
        if got is None:
            if not self.same(tgt, self.target()):
                self.fail("restore_none_after_touch", "restore() returned None, state changed")
            if clean and expect is not None:
                self.fail("restore_none", f"restore() returned None; step {expect} is valid")
            return None
        if not any(self.same(tgt, w) for w in wants.get(got, [])):
            self.fail("restore_wrong_data", f"restore() returned step {got} with other data")
        if clean and got != expect:
            self.fail("restore_not_newest", f"restore() gave step {got}, newest valid is {expect}")
        return int(got)

    def check_restore_step(self, step: int, *, clean: bool) -> None:
        with self.plan.off():
            live = self.live_copies()
            intact = any(self.valid_copy(d, step, live) for _, d, _ in self.tiers)
            wants = self.wanted(step, live)
        tgt = self.target()
        count("checks.restore")
        try:
            got = self.ckpt.restore(tgt, step=step)
        except flashckpt.FlashCkptError as exc:
            if clean and intact:
                self.fail("restore_raised", f"restore(step={step}) raised though valid: {exc}")
            return
        except Exception as exc:
            self.fail("non_flashckpt_error", f"restore(step={step}) raised {exc!r}")
        if got != step or not any(self.same(tgt, w) for w in wants):
            self.fail("restore_wrong_data", f"restore(step={step}) gave {got} with other data")
