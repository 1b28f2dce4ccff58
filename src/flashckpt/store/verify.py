"""Re-hash every chunk a checkpoint references.

Lock-free: a trainer may be saving and collecting garbage at the same time. A step whose
manifest or chunk goes missing while it is verified is re-checked: if retention deleted it
meanwhile, it is reported as ``vanished``, never as damage. A chunk whose bytes are wrong is
quarantined by the store's read (:mod:`flashckpt.store.liveness`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from flashckpt.errors import FlashCkptError, NoCheckpointError
from flashckpt.store.store import CheckpointStore


@dataclass(kw_only=True)
class VerifyReport:
    step: int
    problems: list[str] = field(default_factory=list)
    chunks: int = 0
    bytes: int = 0
    vanished: bool = False  # retention deleted the step while it was being verified

    @property
    def ok(self) -> bool:
        return not self.problems


def verify_step(
    store: CheckpointStore,
    step: int,
    *,
    checked: dict[str, str | None] | None = None,
    progress: Callable[[int], None] | None = None,
) -> VerifyReport:
    """Verify one step; ``checked`` caches per-chunk results across steps (None = good)."""
    report = VerifyReport(step=step)
    cache = checked if checked is not None else {}
    try:
        manifest = store.load_manifest(step)
    except NoCheckpointError:
        report.vanished = True
        return report
    except FlashCkptError as exc:
        report.problems.append(str(exc))
        return _unless_vanished(store, report)
    owners: dict[int, str] = {}
    for key, entry in manifest.tensors.items():
        for shard in entry.shards:
            for ext in shard.extents:
                owners.setdefault(ext.chunk, key)
    for i, ref in enumerate(manifest.chunks):
        if ref.hash not in cache:
            try:
                store.read_chunk(ref, step=step, key=owners.get(i))
                cache[ref.hash] = None
            except FlashCkptError as exc:
                cache[ref.hash] = str(exc)
        if cache[ref.hash] is not None:
            report.problems.append(f"step {step}: tensor {owners.get(i)!r}: {cache[ref.hash]}")
        report.chunks += 1
        report.bytes += ref.size
        if progress:
            progress(ref.size)
    return _unless_vanished(store, report) if report.problems else report


def _unless_vanished(store: CheckpointStore, report: VerifyReport) -> VerifyReport:
    """A problem found in a step that is no longer listed was a race with retention."""
    if store.has_step(report.step):
        return report
    return VerifyReport(step=report.step, vanished=True)
