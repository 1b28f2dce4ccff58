"""What one save borrows from its Checkpointer, and how the state is laid out for it.

Device ordering (engine/device.py): at ``save()`` one event is recorded per device the state
lives on, on that device's current stream (never the current device's: a rank that moved its
model to ``cuda:N`` without ``set_device`` queues its step on N). The save stages each device's
chunks on that device's own side stream, which waits for that device's event; the side streams
are made once per Checkpointer (:class:`SideStreams`), since the caching allocator keeps memory
per stream.
"""

from __future__ import annotations

import threading
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any

from flashckpt.engine import device as devices
from flashckpt.engine.device import DeviceOps
from flashckpt.engine.options import Options
from flashckpt.engine.save.copier import Copier
from flashckpt.engine.save.fingerprint import Fingerprinter
from flashckpt.engine.save.layout import ChunkPlan, plan_chunks
from flashckpt.engine.save.staging import StagingPool
from flashckpt.state.capture import Captured
from flashckpt.store.files.directio import aligned
from flashckpt.store.format.dtypes import itemsize
from flashckpt.store.format.lineage import Lineage
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
    # device -> event recorded on that device's current stream at save()
    events: dict[str, Any] = field(default_factory=dict)
    device: DeviceOps = field(default_factory=devices.current)
    streams: SideStreams = field(default_factory=lambda: SideStreams())
    # CPU chunks are staged straight into the tier's chunk files (a memory tier: the staged
    # copy is the tier's copy; engine/save/job.py SaveJob._stage_direct)
    direct: bool = False
    # region of a chunk -> whether it changed at the last save (copy first when it did)
    hints: dict[tuple[Any, ...], bool] = field(default_factory=dict)
    lineage: Lineage | None = None  # the writer's (store/format/lineage.py)
    # the last save's manifest draft and what it was made from (engine/save/manifests.py)
    drafts: DraftMemo = field(default_factory=lambda: DraftMemo())
    # splits a staging copy across threads while the loop waits for it (engine/save/copier.py)
    copier: Copier = field(default_factory=Copier)


class DraftMemo:
    """One Checkpointer's last manifest draft, kept so that a save laid out exactly like the
    one before (the same keys, dtypes, shapes and chunk layout: every save of a training run
    but the first) reuses its tensor entries and their JSON (engine/save/manifests.py). Set
    and read as one tuple (a save's draft is made on one thread at a time)."""

    def __init__(self) -> None:
        self.last: tuple[Any, Any] | None = None  # (layout signature, Draft)


class SideStreams:
    """One side stream per device for the life of a Checkpointer (made under that device)."""

    def __init__(self) -> None:
        self._streams: dict[str, Any] = {}
        self._lock = threading.Lock()

    def get(self, ops: DeviceOps, device: str) -> Any:
        with self._lock:
            s = self._streams.get(device)
            if s is None:
                s = self._streams[device] = ops.stream(device)
            return s

    def __len__(self) -> int:
        return len(self._streams)


def wait_for_host_copies(captured: Captured, ops: DeviceOps) -> None:
    """Pinned CPU tensors of the state may still be filled by a ``non_blocking`` device-to-host
    copy queued before ``save()``: before any of their bytes is read, wait (on this thread) for
    the work queued so far on the current stream of every device this process has a context
    on. Nothing to wait for without a context (no copy can be in flight), and
    ``is_pinned`` is not asked then (it would create one)."""
    if not ops.has_context():
        return
    if not any(
        i.kind == "torch" and ops.device_of(i.data) == "cpu" and ops.is_pinned(i.data)
        for i in captured.items
    ):
        return
    for dev in ops.active_devices():
        ops.host_wait(ops.event(dev))


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
    streams: SideStreams | None = None,
    lineage: Lineage | None = None,
    drafts: DraftMemo | None = None,
    copier: Copier | None = None,
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
    on = list(dict.fromkeys(c.device for c in chunks if c.device != "cpu"))  # state's devices
    on_device = bool(on)
    direct = direct and o.async_save and o.compression is None and store.stage_chunk_supported
    use_pool = (o.async_save and not direct) or on_device
    if use_pool:
        needed = sum(aligned(c.size) for c in chunks if not (direct and c.device == "cpu"))
        pin = on_device and ops.available()
        pool.reserve(needed_bytes=needed, pin=pin, device=on[0] if on else None)
    # each device's side stream waits for the work queued on that device before save()
    events = {dev: ops.event(dev) for dev in on}
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
        events=events,
        device=ops,
        streams=streams if streams is not None else SideStreams(),
        direct=direct,
        hints=hints if hints is not None else {},
        lineage=lineage,
        drafts=drafts if drafts is not None else DraftMemo(),
        copier=copier if copier is not None else Copier(),
    )
    return chunks, ctx
