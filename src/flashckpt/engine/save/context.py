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
    # CPU chunks are staged straight into the tier's chunk files (a memory tier: the staged
    # copy is the tier's copy; engine/save/job.py SaveJob._stage_direct)
    direct: bool = False
    # region of a chunk -> whether it changed at the last save (copy first when it did)
    hints: dict[tuple[Any, ...], bool] = field(default_factory=dict)


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
    direct: bool = False,
    hints: dict[tuple[Any, ...], bool] | None = None,
) -> tuple[list[ChunkPlan], SaveContext]:
    """Lay the captured state out in chunks and gather what its save job borrows. Staging goes
    through the pool when the save is asynchronous or the bytes live on a device; a
    synchronous CPU save persists straight from the live tensors. ``direct`` (an asynchronous
    save to a memory tier, uncompressed): CPU chunks are staged into the tier's files instead,
    and the pool is sized for the device chunks only."""
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
    direct = direct and o.async_save and o.compression is None and store.stage_chunk_supported
    use_pool = (o.async_save and not direct) or on_device
    if use_pool:
        needed = sum(aligned(c.size) for c in chunks if not (direct and c.device == "cpu"))
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
        direct=direct,
        hints=hints if hints is not None else {},
    )
    return chunks, ctx
