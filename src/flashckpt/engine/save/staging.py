"""The staging pool: one host arena allocated once, reused by every save, bounded by a budget.

A staged chunk takes a page-aligned range of the arena sized to the chunk (a 4 KiB bias and a
32 MiB weight slice cost what they hold, so a state of many small tensors stages in one pass
instead of waiting on writes for lack of fixed-size slots), and gives it back in ``finally``
when the chunk is written. The arena is at least one full chunk, so one chunk is always
admitted when nothing is in flight and a state larger than the budget flows through in waves
without deadlock. Ranges start on 4096-byte boundaries so the disk tier can write them with
O_DIRECT (store/files/directio.py). On CUDA the arena is pinned: page-aligned anonymous memory,
page-locked in pieces of :data:`PIN_PIECE` with ``cudaHostRegister`` (one ``cudaHostAlloc`` of the
whole arena would hold the driver's global lock for seconds per GB, stalling the training thread's
launches, and torch's pinned allocator rounds it up to a power of two and caches it after free).
The arena is exactly what the save needs, within ``host_memory_budget``; an arena that grows
unregisters and gives its old pages back before it asks for the new ones, and close does the
same. If pinning fails it falls back to pageable memory with a warning (the pieces already
locked are unlocked).
The pinning goes through engine/device.py, under the device of the save's first device chunk.

A fresh arena costs its page faults on first touch (measured on the 2-core CPU host: 3.2-3.6 s
to first write 1.2 GB, 0.5 s to write it again), so a new Checkpointer reserves and populates it
in the background (:meth:`StagingPool.warm`, started by engine/save/warmup.py; the kernel faults
each piece in with ``MADV_POPULATE_WRITE``) before the first save needs it, never holding the
pool's lock while it waits or faults, so a save never waits for that low-priority thread; an
arena a save reserves itself (a fresh root: nothing sized it before) is mapped with
``MAP_POPULATE``, which faults it in about twice as fast as the first copy would; :meth:`close`
gives the memory back. Tried and dropped (BENCHMARKS.md, "Cold first save"): transparent huge
pages, twice (on a VM whose host takes back free guest memory, populating 512 MiB took 1.0-1.2
s instead of 0.12 s), populating on several threads (no faster) and a thread faulting ahead of
the copies (15 ms of 200).
With a memory tier on tmpfs the arena is a file there instead (engine/tiers/arena.py), whose
pages outlive a killed process: a restarted process maps them resident, and its first save
copies at the speed of a warm one.
"""

from __future__ import annotations

import bisect
import logging
import mmap
import threading

import numpy as np
import torch

from flashckpt.engine import device as devices
from flashckpt.engine.tiers.arena import ArenaFile
from flashckpt.store.files.directio import aligned

log = logging.getLogger(__name__)

PAGE = 4096
TOUCH_PIECE = 64 << 20  # warm() checks its stop event this often
PIN_PIECE = (
    64 << 20
)  # bytes page-locked per cudaHostRegister call (the driver lock is free between)


class StagingPool:
    def __init__(
        self,
        *,
        budget_bytes: int,
        chunk_bytes: int,
        backing: ArenaFile | None = None,
        fault_in: bool = True,
    ) -> None:
        """``fault_in``: :meth:`reserve` faults what no warm-up did in before the save copies
        (False: the copies take the faults, split across threads when the loop waits for them:
        engine/save/copier.py)."""
        self.chunk_bytes = aligned(chunk_bytes)
        self.budget_bytes = max(budget_bytes, self.chunk_bytes)
        self._arena: torch.Tensor | None = None
        self._pinned = False
        self._pin_tried = False
        self._free: list[tuple[int, int]] = []  # (start, end) byte ranges, sorted, merged
        self._taken: dict[int, int] = {}  # start -> length of each range handed out
        self._cond = threading.Condition()
        self._touched = 0  # bytes of the arena known resident (faulted in by warm(), or mapped)
        self._backing = backing  # a file for the pageable arena (engine/tiers/arena.py), or None
        self._file_backed = False  # the arena now is that file
        self.reused_bytes = 0  # bytes of a file arena an earlier process left allocated
        self._closed = False
        self._map: mmap.mmap | None = None  # an anonymous arena's mapping (madvise in warm())
        self._claimed = False  # a save has reserved: the warm-up touches no further piece
        self._fault_in = fault_in

    @property
    def capacity_bytes(self) -> int:
        return 0 if self._arena is None else self._arena.numel()

    @property
    def pinned(self) -> bool:
        return self._pinned

    def reserve(self, *, needed_bytes: int, pin: bool, device: str | None = None) -> None:
        """Size the arena for a save staging ``needed_bytes`` (the sum of :func:`aligned` chunk
        sizes), never beyond the budget and never below one chunk. Called between saves only;
        the arena grows at most once per new high-water mark. ``device``: where a pinned
        arena's context is (the save's first device)."""
        with self._cond:
            if self._taken:
                raise RuntimeError("staging pool resized while chunks are staged")
            self._claimed = True  # a warm-up still touching stops before its next piece
            self._reserve_locked(needed_bytes, pin, device, populate=self._fault_in)
            if not self._fault_in:
                return
            if self._arena is not None and not self._pinned and self._touched < self.capacity_bytes:
                # what the warm-up did not reach: faulted in here, by the save's own thread,
                # never waited for on a warm-up that runs at the background CPU level
                self._touch(self._arena.numpy(), self._touched, self.capacity_bytes)

    def _reserve_locked(
        self, needed_bytes: int, pin: bool, device: str | None = None, *, populate: bool = False
    ) -> bool:
        """:meth:`reserve` under the lock; True when it allocated a new arena. ``populate``: a
        save needs the arena now, so an anonymous one is faulted in by the kernel as it is
        mapped (``MAP_POPULATE``: 0.20 s for 512 MiB on the 2-core VM, against 0.36 s when the
        first copy into it takes the faults page by page)."""
        want = min(self.budget_bytes, max(self.chunk_bytes, aligned(needed_bytes)))
        if want <= self.capacity_bytes and (self._pin_tried or not pin):
            return False  # (pinning is tried once: a host that refused it is not asked again)
        want = max(want, self.capacity_bytes)
        self._drop_arena()  # the old pages go back first: never two arenas at once
        self._arena, self._file_backed, self._pinned = self._alloc(want, pin, device, populate)
        self._pin_tried = self._pin_tried or pin
        self._free = [(0, want)]
        # a mapped file arena is resident, and so are a page-locked and a populated one
        self._touched = want if self._file_backed or self._pinned or populate else 0
        return True

    def _alloc(
        self, nbytes: int, pin: bool, device: str | None, populate: bool = False
    ) -> tuple[torch.Tensor, bool, bool]:
        """The arena, whether it is the file (allocated and mapped: resident) and whether it is
        pinned: the file when there is one and the arena is pageable, else anonymous (or
        pinned) memory."""
        self._map = None
        if not pin and self._backing is not None:
            got = self._backing.map(nbytes)
            if got is not None:
                self.reused_bytes = got.reused_bytes
                return got.tensor, True, False
            self._backing = None  # refused (logged): not asked again
        if pin:
            pinned = _pin(nbytes, device)
            if pinned is not None:
                return pinned, False, True
        arena, self._map = _alloc(nbytes, populate=populate)
        return arena, False, False

    def _drop_arena(self) -> None:
        """Let go of the arena; a pinned one is unlocked first (its pages go back to the system
        when the last view of it is dropped)."""
        arena, pinned, self._arena, self._pinned = self._arena, self._pinned, None, False
        self._map = None
        if pinned and arena is not None:
            _unregister(arena, arena.numel())

    def warm(
        self, *, needed_bytes: int, pin: bool, stop: threading.Event, device: str | None = None
    ) -> None:
        """:meth:`reserve` ahead of the first save, then fault every page of the arena in, so
        that save copies into resident memory. For a background thread, which runs at the
        background CPU level: a save never waits for it. The lock is free between pieces and
        ``madvise`` (which keeps what a page holds) runs outside it; a save's :meth:`reserve`
        stops the warm-up before its next piece and faults what is left in itself. ``stop``
        (set by close) ends it between pieces. Does nothing when chunks are staged, a save
        has reserved, or the pool is closed."""
        with self._cond:
            if self._taken or self._closed or self._claimed:
                return
            self._reserve_locked(needed_bytes, pin, device)
            arena, buf = self._arena, self._map
            if arena is None or self._pinned:
                return  # a pinned arena is resident already (page-locking faults its pages in)
        flat = arena.numpy()
        while not stop.is_set():
            with self._cond:
                if self._claimed or self._taken or self._arena is not arena:
                    return  # a save has the arena now
                start = self._touched
                end = min(flat.size, start + TOUCH_PIECE)
                if start >= end:
                    return
                if buf is None:  # no madvise: writes, so only while no save can stage
                    _touch_pages(flat, start, end)
                    self._touched = end
                    continue
            if not _populate(buf, start, end - start):  # the kernel lacks it: as above
                with self._cond:
                    self._map = buf = None
                continue
            with self._cond:
                if self._arena is arena:
                    self._touched = max(self._touched, end)

    def _touch(self, flat: np.ndarray, start: int, end: int) -> None:
        """Fault ``[start, end)`` in (under the lock, no chunk staged)."""
        if not _populate(self._map, start, end - start):
            _touch_pages(flat, start, end)
        self._touched = end

    @property
    def touched_bytes(self) -> int:
        """Bytes of the arena known resident: faulted in by :meth:`warm`, or a file arena's
        allocated and mapped pages (tests, benchmarks)."""
        return self._touched

    @property
    def file_backed(self) -> bool:
        """True when the arena is the memory tier's file (engine/tiers/arena.py)."""
        return self._arena is not None and self._file_backed

    def close(self) -> None:
        """Give the arena back (Checkpointer.close, after its threads stopped). Idempotent."""
        with self._cond:
            self._closed = True
            if self._backing is not None:  # a clean close leaves no arena in the tier
                self._backing.remove()  # (a mapping still in use stays valid until dropped)
                self._backing = None
            if self._taken:
                return  # a chunk still staged (a worker that could not be stopped): keep it
            self._drop_arena()
            self._file_backed = False
            self._free = []
            self._touched = 0

    def try_acquire(self, nbytes: int) -> int | None:
        """The start of a free range of ``nbytes`` (first fit), or None when none is free."""
        size = aligned(nbytes)
        with self._cond:
            return self._take(size)

    def acquire(self, nbytes: int) -> int:
        """Like :meth:`try_acquire`, waiting for a range to be released."""
        size = aligned(nbytes)
        if size > self.capacity_bytes:
            raise RuntimeError(
                f"a {nbytes}-byte chunk does not fit the {self.capacity_bytes}-byte arena"
            )
        with self._cond:
            while (start := self._take(size)) is None:
                self._cond.wait()
            return start

    def release(self, start: int) -> None:
        with self._cond:
            end = start + self._taken.pop(start)
            i = bisect.bisect_left(self._free, (start, end))
            if i < len(self._free) and self._free[i][0] == end:  # merge with the next range
                end = self._free.pop(i)[1]
            if i > 0 and self._free[i - 1][1] == start:  # and with the previous one
                start = self._free.pop(i - 1)[0]
                i -= 1
            self._free.insert(i, (start, end))
            self._cond.notify_all()

    def view(self, start: int, nbytes: int) -> torch.Tensor:
        if self._arena is None:
            raise RuntimeError("staging pool used before reserve()")
        return self._arena[start : start + nbytes]

    def _take(self, size: int) -> int | None:
        for i, (lo, hi) in enumerate(self._free):
            if hi - lo >= size:
                if hi - lo == size:
                    del self._free[i]
                else:
                    self._free[i] = (lo + size, hi)
                self._taken[lo] = size
                return lo
        return None


def _pin(nbytes: int, device: str | None) -> torch.Tensor | None:
    """``nbytes`` of page-aligned memory page-locked in pieces of :data:`PIN_PIECE`, or None
    (logged: use pageable; whatever was locked is unlocked again)."""
    ops = devices.current()
    arena = torch.frombuffer(mmap.mmap(-1, nbytes), dtype=torch.uint8)  # page-aligned
    done = 0
    try:
        while done < nbytes:
            piece = min(PIN_PIECE, nbytes - done)
            ops.register(arena[done : done + piece], device)
            done += piece
    except RuntimeError as exc:
        _unregister(arena, done)
        log.warning("could not pin %d bytes of staging memory (%s); using pageable", nbytes, exc)
        return None
    return arena


def _unregister(arena: torch.Tensor, nbytes: int) -> None:
    """Unlock the first ``nbytes`` of ``arena`` (locked by :func:`_pin`, piece by piece)."""
    ops = devices.current()
    for start in range(0, nbytes, PIN_PIECE):
        try:
            ops.unregister(arena[start : min(nbytes, start + PIN_PIECE)])
        except RuntimeError as exc:  # the pages stay locked until the process ends
            log.warning("could not unpin staging memory: %s", exc)


MADV_POPULATE_WRITE = 23  # Linux 5.14+ (Python 3.11's mmap module lacks the name)


def _alloc(nbytes: int, *, populate: bool = False) -> tuple[torch.Tensor, mmap.mmap]:
    """``nbytes`` of pageable anonymous memory, page-aligned, and its mapping (its pages go
    back to the system when the last view is dropped); ``populate``: faulted in as it is
    mapped."""
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
    if populate:
        flags |= getattr(mmap, "MAP_POPULATE", 0)
    m = mmap.mmap(-1, nbytes, flags=flags)
    return torch.frombuffer(m, dtype=torch.uint8), m


def _touch_pages(flat: np.ndarray, start: int, end: int) -> None:
    """Write one byte per page of ``flat[start:end]`` with numpy (a torch op here would start
    torch's intra-op threads beside the training thread's); only where nothing is staged."""
    flat[start:end:PAGE] = 0


def _populate(buf: mmap.mmap | None, start: int, length: int) -> bool:
    """Fault ``length`` bytes of an anonymous arena in from ``start`` with one
    ``madvise(MADV_POPULATE_WRITE)`` (0.27 s for 512 MiB against 0.36 s touching each page
    from Python); False when the kernel cannot, and the caller touches the pages itself."""
    if buf is None:
        return False
    try:
        buf.madvise(MADV_POPULATE_WRITE, start, length)
    except (OSError, ValueError):
        return False
    return True
