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
