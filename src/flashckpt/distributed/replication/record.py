"""What a node's memory tier says was replicated: ``<memory tier>/replication.json``.

Written by each node's leader after a replication round succeeded (atomically, no fsync: the
file lives in RAM like the tier), and when replication stopped for good (with the reason);
read by ``flashckpt ls`` / ``status`` and by the tests. Bounded and parsed defensively: a
damaged or oversized record reads as empty (nothing is claimed replicated), never as an error.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from flashckpt.errors import FlashCkptError
from flashckpt.store.files import safeopen
from flashckpt.store.files.jsonfile import load_json

log = logging.getLogger(__name__)

RECORD_NAME = "replication.json"  # at the tier root: never parsed as a step (store/format/names.py)
MAX_RECORD_BYTES = 4 << 20


def read_record(tier: Path) -> dict[str, Any]:
    """``{"replicated": {step: {...}}, "stopped": reason | None}`` of a node tier ({} if none)."""
    try:
        data = safeopen.read_file(tier, RECORD_NAME, max_bytes=MAX_RECORD_BYTES)
        doc = load_json(data, where=str(tier / RECORD_NAME), max_bytes=MAX_RECORD_BYTES)
    except FileNotFoundError:
        return {}
    except (FlashCkptError, OSError, ValueError) as exc:
        log.warning("ignoring unreadable %s: %s", tier / RECORD_NAME, exc)
        return {}
    reps = doc.get("replicated") if isinstance(doc, dict) else None
    if not isinstance(reps, dict):
        return {}
    out = {int(k): v for k, v in reps.items() if k.isdigit() and isinstance(v, dict)}
    return {"replicated": out, "stopped": doc.get("stopped")}


def replicated_steps(tier: Path) -> set[int]:
    """Steps recorded as replicated in the node tier at ``tier``."""
    return set(read_record(tier).get("replicated", {}))


def write_record(tier: Path, replicated: dict[int, dict[str, Any]], stopped: str | None) -> None:
    """Replace the record: ``replicated`` (step -> what the round measured), ``stopped`` (why
    replication stopped for good, or None)."""
    doc = {
        "version": 1,
        "replicated": {str(s): v for s, v in sorted(replicated.items())},
        "stopped": stopped,
    }
    data = json.dumps(doc, indent=1).encode()
    safeopen.write_file_atomic(tier, RECORD_NAME, data, fsync=False)
