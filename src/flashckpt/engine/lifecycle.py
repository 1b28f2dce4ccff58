"""The run marker: how a new run learns that the previous one died without ``close()``.

``start_run`` journals ``crash_detected`` when the previous run's marker is still there, then
``run_start``, writes its own marker and lets the save policy read the journal's history;
``end_run`` journals ``run_end`` and removes the marker.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from flashckpt.journal import Journal, read_events
from flashckpt.store.store import CheckpointStore

MARKER = "locks/running.json"


def start_run(root: Path, journal: Journal, store: CheckpointStore, save_policy: Any) -> None:
    marker = root / MARKER
    crashed = marker.exists()
    if crashed:
        steps = store.steps()
        journal.append(
            "crash_detected",
            last_step=steps[-1] if steps else None,
            since_t=marker.stat().st_mtime,
        )
    journal.append("run_start", clean_previous=not crashed)
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.write_text(f'{{"pid": {os.getpid()}, "t": {time.time()}}}')
    observe = getattr(save_policy, "observe_history", None)
    if observe is not None:
        observe(read_events(journal.path))


def end_run(root: Path, journal: Journal, last_step: int | None) -> None:
    journal.append("run_end", step=last_step)
    (root / MARKER).unlink(missing_ok=True)
