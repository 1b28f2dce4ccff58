"""Quarantine on disk: confirm that a chunk file is damaged, and move it out of ``chunks/``.

:meth:`flashckpt.store.liveness.Liveness.quarantine` owns the decision and the bookkeeping
(which chunks are forgotten and never reused); this module is what it does to the tier: read
the file once more and check its bytes against the reference, then move it under
``quarantine/`` (local tiers, through the safe-open gateway) or delete it (remote tiers).
"""

from __future__ import annotations

import time
from pathlib import Path

from flashckpt.errors import CorruptCheckpointError
from flashckpt.store.files import safeopen
from flashckpt.store.files.backend import Backend
from flashckpt.store.format import codec as codecs
from flashckpt.store.format.manifest import ChunkRef

QUARANTINE_DIR = "quarantine"


def still_damaged(backend: Backend, ref: ChunkRef, path: str) -> bool:
    """Whether the file at ``path`` is there and does not hold ``ref``'s bytes."""
    try:
        stored = backend.read(path)
    except FileNotFoundError:
        return False
    try:
        raw = codecs.decode(stored, ref.codec, ref.size, chunk=ref.hash)
    except CorruptCheckpointError:
        return True
    return len(raw) != ref.size or codecs.hash_parts([raw]) != ref.hash


def move_away(backend: Backend, root: Path | None, path: str) -> None:
    """Move ``path`` under ``root/quarantine/`` (a remote tier, ``root`` None: delete it)."""
    if root is None:
        backend.delete(path)
        return
    # through the gateway: a quarantine/ that is a symlink is refused, never followed
    safeopen.rename_into(root, path, QUARANTINE_DIR, f"{Path(path).name}.{time.time_ns()}")
