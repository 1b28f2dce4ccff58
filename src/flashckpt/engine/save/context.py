"""What one save borrows from its Checkpointer, and how the state is laid out for it."""

from __future__ import annotations

from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any

from flashckpt.engine import device as devices
from flashckpt.engine.device import DeviceOps
from flashckpt.engine.options import Options
from flashckpt.engine.save.fingerprint import Fingerprinter
from flashckpt.engine.save.layout import ChunkPlan, plan_chunks
from flashckpt.engine.save.staging import StagingPool
from flashckpt.state.capture import Captured
from flashckpt.store.files.directio import aligned
from flashckpt.store.format.dtypes import itemsize
from flashckpt.store.store import CheckpointStore


@dataclass(kw_only=True)
class SaveContext:
    """What a save job borrows from its Checkpointer for its lifetime."""

    store: CheckpointStore
    pool: StagingPool | None  # None: persist straight from live memory (synchronous saves)
    workers: Executor
    compression: str | None
    incremental: bool
    fingerprinter: Fingerprinter | None
    fingerprints: dict[tuple[Any, ...], tuple[tuple[int, int], str]]
    library: str
    rank: int = 0
    world_size: int = 1
    cuda_event: Any = None  # recorded on the training stream at save()
    device: DeviceOps = field(default_factory=devices.current)


def build_context(
    captured: Captured,
    o: Options,
    *,
    store: CheckpointStore,
    pool: StagingPool,
    workers: Executor,
    fingerprinter: Fingerprinter | None,
    fingerprints: dict[tuple[Any, ...], tuple[tuple[int, int], str]],
    rank: int,
    world_size: int,
) -> tuple[list[ChunkPlan], SaveContext]:
    """Lay the captured state out in chunks and gather what its save job borrows. Staging goes
    through the pool when the save is asynchronous or the bytes live on a device; a
    synchronous CPU save persists straight from the live tensors."""
    from flashckpt.version import __version__

    ops = devices.current()
    chunks = plan_chunks(
        captured.items,
        chunk_bytes=o.chunk_bytes,
        pack_bytes=min(o.pack_bytes, o.chunk_bytes),
        pack_threshold_bytes=min(o.pack_threshold_bytes, o.chunk_bytes),
        itemsizes=[itemsize(i.kind, i.dtype) for i in captured.items],
        device_of=ops.device_of,
    )
    on_device = any(c.device != "cpu" for c in chunks)
    use_pool = o.async_save or on_device
    if use_pool:
        needed = sum(aligned(c.size) for c in chunks)
        pool.reserve(needed_bytes=needed, pin=on_device and ops.available())
    # staging on a side stream must wait for work queued before save()
    event = ops.event() if on_device else None
    ctx = SaveContext(
        store=store,
        pool=pool if use_pool else None,
        workers=workers,
        compression=o.compression,
        incremental=o.incremental,
        fingerprinter=fingerprinter if on_device else None,
        fingerprints=fingerprints,
        library=__version__,
        rank=rank,
        world_size=world_size,
        cuda_event=event,
        device=ops,
    )
    return chunks, ctx
