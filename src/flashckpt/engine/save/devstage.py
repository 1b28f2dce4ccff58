"""Staging the device chunks of a save (:class:`~flashckpt.engine.save.job.SaveJob` uses it).

Every chunk holds bytes of one device (engine/save/layout.py) and is staged on *that* device's
side stream (engine/save/context.py :class:`SideStreams`, one per device per Checkpointer), which
first waits for the event ``save()`` recorded on that device's current stream: the
fingerprint (an unchanged chunk never leaves the device) runs there, in bounded windows
(engine/save/fingerprint.py), then the ``non_blocking`` copies into a pinned staging range, and
the host waits for that stream before the bytes are handed on. When a copy fails, the range is
given back only after the copies already issued into it have landed. The job hands in what
the decisions need as callables, so this module knows nothing of it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from flashckpt.engine.save.context import SaveContext
from flashckpt.engine.save.layout import ChunkPlan

log = logging.getLogger(__name__)


class DeviceStager:
    def __init__(
        self,
        ctx: SaveContext,
        *,
        reuse: Callable[[int, str, int], bool],
        acquire: Callable[[int], int],
        submit: Callable[..., None],
    ) -> None:
        """``reuse(ci, h, size)``: the job's write-or-reuse decision; ``acquire(nbytes)``: a
        staging range; ``submit(ci, h, chunk, bufs, slot, fingerprint)``: hand a staged chunk
        on (``h=None``: a persist worker hashes it)."""
        self.ctx = ctx
        self._reuse, self._acquire, self._submit = reuse, acquire, submit
        self._streams: dict[str, Any] = {}  # device -> its side stream, once it waited

    def stream_for(self, device: str) -> Any:
        """``device``'s side stream, ordered after that device's event (once per save)."""
        s = self._streams.get(device)
        if s is None:
            ops = self.ctx.device
            s = self.ctx.streams.get(ops, device)
            event = self.ctx.events.get(device)
            if event is not None:
                ops.wait(s, event)
            self._streams[device] = s
        return s

    def stage(self, ci: int, chunk: ChunkPlan, parts: list[torch.Tensor], key: Any) -> None:
        """Stage chunk ``ci`` (``parts``: its device bytes; ``key``: its region)."""
        ops = self.ctx.device
        stream = self.stream_for(chunk.device)
        fp, expect = None, None
        fingerprinter = self.ctx.fingerprinter
        if fingerprinter is not None:
            fp = ops.run(stream, lambda: fingerprinter.of_parts(parts))
            prev = self.ctx.fingerprints.get(key)
            if prev is not None and prev[0] == fp:
                if self._reuse(ci, prev[1], chunk.size):
                    return
                # unchanged, but the store lacks the chunk (a failed save, gc, quarantine):
                # it is now claimed by this save, which must write it
                expect = prev[1]
        pool = self.ctx.pool
        if pool is None:
            raise RuntimeError("device tensors need a staging pool")
        slot = self._acquire(chunk.size)
        try:
            buf = pool.view(slot, chunk.size)
            with ops.use(stream):
                pos = 0
                for p in parts:
                    buf[pos : pos + p.numel()].copy_(p, non_blocking=True)
                    pos += p.numel()
            ops.synchronize(stream)
        except BaseException:
            self._release_after_copies(slot, stream)
            raise
        # the chunk is on the host: staged. Hashing (GIL-bound) happens in a persist worker so
        # the optimizer hook waits only for the device-to-host copies.
        self._submit(ci, None, chunk, [buf.numpy()], slot, (key, fp, expect))

    def _release_after_copies(self, slot: int, stream: Any) -> None:
        """Give a failed chunk's range back only once no copy issued into it can still land
        (a later chunk would be overwritten by a late DMA); when the stream cannot be waited
        on, the range stays taken (logged), never reused."""
        try:
            self.ctx.device.synchronize(stream)
        except BaseException as exc:
            log.error("staging range kept: its device copies could not be waited on (%s)", exc)
            return
        if self.ctx.pool is not None:
            self.ctx.pool.release(slot)
