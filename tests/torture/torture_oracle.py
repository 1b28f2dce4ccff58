"""The oracle: what the public API promised, and the ground truth on disk.

The ground truth is read with plain file I/O, never through the library: a step is *intact* in
a tier when its manifest parses and every chunk it names exists with the recorded size and a
content hash (xxh3-128) equal to its name. The oracle then asks, after every operation:

* ``retained``: every committed step that the tier's retention keeps is still there;
* ``intact``: and intact, unless damage the harness itself caused (a taint) explains it;
* ``no_manifest_after_failure``: a save that failed left no manifest in any tier;
* restore results (see :mod:`torture_sim`) against the recorded payloads.

Violations carry an invariant name; names listed in :mod:`torture_known` are bugs fixed on
another branch and are counted, not failed, unless ``FLASHCKPT_TORTURE_STRICT=1``.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import xxhash
from torture_faults import Taint, count

STEP_RE = re.compile(r"^(\d{1,15})\.json$")
_SUFFIX = {
    "raw": "",
    "zstd": ".zst",
    "zstd+shuf2": ".zs2",
    "zstd+shuf4": ".zs4",
    "zstd+shuf8": ".zs8",
}


@dataclass(frozen=True)
class Violation:
    invariant: str
    detail: str


class ViolationError(AssertionError):
    def __init__(self, v: Violation) -> None:
        super().__init__(f"[{v.invariant}] {v.detail}")
        self.violation = v


def disk_steps(tier: Path) -> list[int]:
    try:
        names = os.listdir(tier / "steps")
    except FileNotFoundError:
        return []
    return sorted(int(m.group(1)) for n in names if (m := STEP_RE.match(n)))


def manifest_path(step: int) -> str:
    return f"steps/{step:012d}.json"


def chunk_rel(h: str, codec: str) -> str:
    return f"chunks/{h[:2]}/{h}{_SUFFIX.get(codec, '.unknown')}"


def read_manifest(tier: Path, step: int) -> dict[str, Any] | None:
    try:
        doc = json.loads((tier / manifest_path(step)).read_bytes())
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) and isinstance(doc.get("chunks"), list) else None


def chunk_problem(tier: Path, entry: list[Any]) -> str | None:
    """None when the chunk is intact on disk, else what is wrong (raw chunks are hashed;
    compressed ones are checked for presence and stored size)."""
    h, size, codec, stored = entry
    p = tier / chunk_rel(h, codec)
    try:
        data = p.read_bytes()
    except FileNotFoundError:
        return "missing"
    except OSError as exc:
        return f"unreadable ({exc})"
    if codec == "raw":
        if len(data) != size:
            return f"{len(data)} bytes, expected {size}"
        if xxhash.xxh3_128(data).hexdigest() != h:
            return "content does not match its hash"
        return None
    return None if (not stored or len(data) == stored) else f"{len(data)} stored bytes"


@dataclass
class StepTruth:
    step: int
    present: bool
    manifest_ok: bool
    bad_chunks: dict[str, str] = field(default_factory=dict)  # relpath -> problem

    @property
    def intact(self) -> bool:
        return self.present and self.manifest_ok and not self.bad_chunks


def inspect_step(tier: Path, step: int) -> StepTruth:
    count("checks.disk_step")
    if not (tier / manifest_path(step)).exists():
        return StepTruth(step=step, present=False, manifest_ok=False)
    doc = read_manifest(tier, step)
    if doc is None or doc.get("step") != step:
        return StepTruth(step=step, present=True, manifest_ok=False)
    bad = {}
    for entry in doc["chunks"]:
        prob = chunk_problem(tier, entry)
        if prob is not None:
            bad[chunk_rel(entry[0], entry[2])] = prob
    return StepTruth(step=step, present=True, manifest_ok=True, bad_chunks=bad)


def temp_files(*dirs: Path) -> list[str]:
    out = []
    for d in dirs:
        for base, _, names in os.walk(d):
            if os.path.basename(base) == "locks":
                continue
            out += [os.path.join(base, n) for n in names if ".tmp-" in n]
    return sorted(out)


def excused(truth: StepTruth, tier: Path, committed_op: int, taints: list[Taint]) -> bool:
    """Damage the harness caused explains every bad chunk (or the bad manifest) of ``truth``:
    a rotted chunk (any time), or a chunk torn / removed / damaged in place at its size
    (``inplace``) at or after the step's commit (a chunk damaged *before* the commit must not
    have been reused by it: issue 27). A step excused this way may be reported damaged by a
    restore or ``verify``, never restored with other bytes (the restore checks)."""
    mine = [t for t in taints if t.tier == str(tier)]
    if any(t.kind == "vanish" and t.path == "" and t.op >= committed_op for t in mine):
        return True  # the whole tier directory was removed
    if not truth.present:
        return False
    if not truth.manifest_ok:
        return any(t.path == manifest_path(truth.step) for t in mine)
    for rel in truth.bad_chunks:
        ok = any(
            t.path == rel and (t.kind in ("bitflip", "rot", "known") or t.op >= committed_op)
            for t in mine
        )
        if not ok:
            return False
    return True


# -- lineage (issue 27): which copy of a step is the checkpoint ------------------------------
# Written apart from the library's judge (store/lineage.py), from the rule as documented: the
# newest generation's chain of branch links is the live branch; a copy of generation g and
# step N is live when g is on the chain and N is at most the step where the chain left g; of
# the live copies of one step the newest generation wins. A copy without a readable lineage
# is left to the damage checks (live here).
LinKey = tuple[str, int]  # (tier dir, step)
Lin = tuple[int, "int | None", "int | None"]  # (generation, parent generation, parent step)


def copy_lineage(tier: Path, step: int) -> Lin | None:
    doc = read_manifest(tier, step)
    if doc is None:
        return None
    lin = doc.get("lineage")
    if lin is None:
        return (0, None, None)
    try:
        return (int(lin["generation"]), lin["parent_generation"], lin["parent_step"])
    except (KeyError, TypeError, ValueError):
        return None


def lineage_live(copies: dict[LinKey, Lin | None]) -> set[LinKey]:
    """The copies on the live branch (and those whose lineage cannot be read)."""
    first: dict[int, tuple[int, Lin]] = {}
    for (_, step), lin in copies.items():
        if lin is not None and (lin[0] not in first or step < first[lin[0]][0]):
            first[lin[0]] = (step, lin)
    if not first:
        return set(copies)
    allowed: dict[int, float] = {}
    cur, bound = max(first), float("inf")
    for g in range(max(first), -1, -1):
        if g != cur:
            continue
        allowed[g] = bound
        link = first[g][1] if g in first else None
        if link is not None and link[2] is not None and link[1] is not None:
            bound = min(bound, link[2])
            cur = link[1]
        else:
            cur = g - 1
    best: dict[int, int] = {}
    for (_, step), lin in copies.items():
        if lin is not None and step <= allowed.get(lin[0], -1.0):
            best[step] = max(best.get(step, -1), lin[0])
    return {
        key
        for key, lin in copies.items()
        if lin is None or (key[1] <= allowed.get(lin[0], -1.0) and best[key[1]] == lin[0])
    }
