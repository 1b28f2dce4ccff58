"""Names at rest: where steps, parts and chunks live under a root (no I/O here)."""

from __future__ import annotations

import re

from flashckpt.errors import CorruptCheckpointError
from flashckpt.store.format.manifest import HASH_RE

# The one definition of a step file's name. ASCII digits only (``\d`` would take any Unicode
# digit), the whole name (``fullmatch``: ``$`` alone accepts a trailing newline), and the exact
# width ``step_name`` writes: 12 digits zero-padded, more only for steps of 10**12 and above
# (no extra leading zero). Anything else in steps/ is not a step, nor a retired one: listings
# ignore it and ``flashckpt verify`` reports it (:func:`stray_step_names`).
STEP_WIDTH = 12
STEP_RE = re.compile(r"([0-9]{12,15})\.json", re.ASCII)
PART_RE = re.compile(r"([0-9]{12,15})\.rank-(0|[1-9][0-9]{0,7})\.json", re.ASCII)
TMP_RE = re.compile(r"\.tmp-([0-9]+)(?:-[0-9]+)?$", re.ASCII)

SUFFIX = {
    "raw": "",
    "zstd": ".zst",
    "zstd+shuf2": ".zs2",
    "zstd+shuf4": ".zs4",
    "zstd+shuf8": ".zs8",
}
CODEC_OF = {v.lstrip("."): k for k, v in SUFFIX.items()}


def _canonical_step(digits: str) -> int | None:
    step = int(digits)
    return step if digits == f"{step:0{STEP_WIDTH}d}" else None


def parse_step_name(name: str) -> int | None:
    """The step of the manifest file name ``name`` (a name in ``steps/``, no directory), or
    None when it is not exactly the name :func:`step_name` writes for some step."""
    m = STEP_RE.fullmatch(name)
    return _canonical_step(m.group(1)) if m else None


def parse_part_name(name: str) -> tuple[int, int] | None:
    """``(step, rank)`` of a part file name (``steps/<step>.rank-<r>.json``), or None."""
    m = PART_RE.fullmatch(name)
    if not m:
        return None
    step = _canonical_step(m.group(1))
    return None if step is None else (step, int(m.group(2)))


def stray_step_names(names: list[str]) -> list[str]:
    """The names in a listing of ``steps/`` that are neither a step, a part nor a temporary
    file: ignored by every reader, reported by ``flashckpt verify``."""
    return [
        n
        for n in names
        if parse_step_name(n) is None and parse_part_name(n) is None and ".tmp-" not in n
    ]


def step_name(step: int) -> str:
    return f"steps/{step:012d}.json"


def part_name(step: int, rank: int) -> str:
    return f"steps/{step:012d}.rank-{rank}.json"


def chunk_path(h: str, codec: str) -> str:
    """``chunks/ab/<hash>`` plus a suffix naming the codec (the name never comes from keys)."""
    if not HASH_RE.match(h) or codec not in SUFFIX:
        raise CorruptCheckpointError(f"invalid chunk name {h!r} / codec {codec!r}", chunk=h)
    return f"chunks/{h[:2]}/{h}{SUFFIX[codec]}"


def parse_chunk_name(name: str) -> tuple[str, str] | None:
    """``(hash, codec)`` of a file name in ``chunks/ab/``, or None for anything else."""
    h, _, ext = name.partition(".")
    if HASH_RE.match(h) and ext in CODEC_OF:
        return h, CODEC_OF[ext]
    return None


def temp_owner(name: str) -> int | None:
    """The pid in a temporary name ``<name>.tmp-<pid>-<n>``, or None."""
    m = TMP_RE.search(name)
    return int(m.group(1)) if m else None
