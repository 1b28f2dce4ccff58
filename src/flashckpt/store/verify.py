"""Re-hash every chunk a checkpoint references."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from flashckpt.errors import FlashCkptError
from flashckpt.store.store import CheckpointStore


@dataclass(kw_only=True)
class VerifyReport:
    step: int
    problems: list[str] = field(default_factory=list)
    chunks: int = 0
    bytes: int = 0

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
    except FlashCkptError as exc:
        report.problems.append(str(exc))
        return report
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
    return report
