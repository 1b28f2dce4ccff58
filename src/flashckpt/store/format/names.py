"""Names at rest: where steps, parts and chunks live under a root (no I/O here)."""

from __future__ import annotations

import re

from flashckpt.errors import CorruptCheckpointError
from flashckpt.store.format.manifest import HASH_RE

STEP_RE = re.compile(r"^(\d{1,15})\.json$")
PART_RE = re.compile(r"^(\d{1,15})\.rank-(\d{1,8})\.json$")
TMP_RE = re.compile(r"\.tmp-(\d+)(?:-\d+)?$")

SUFFIX = {
    "raw": "",
    "zstd": ".zst",
    "zstd+shuf2": ".zs2",
    "zstd+shuf4": ".zs4",
    "zstd+shuf8": ".zs8",
}
CODEC_OF = {v.lstrip("."): k for k, v in SUFFIX.items()}


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
