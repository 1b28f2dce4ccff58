"""Idle scrubbing of the local tiers (memory tier and disk): the cursor of store/scrub.py,
stepped by the promotion thread while it has nothing to copy (engine/tiers/promote.py).

``scrub_bytes_per_s`` (a Checkpointer option; 0 turns it off) bounds the I/O: each step reads
about :data:`STEP_S` seconds' worth of it, and the next waits until the average is back at the
rate. It yields to training and to checkpointing:

* not while a save is in flight, nor for :data:`QUIET_S` after one or after a promotion;
* not while the governor (engine/runtime/governor.py) says idle work waits: the saves'
  background work already costs the loop more than a foreground save would, or the host had
  less than half a core idle since the last look (engine/runtime/hostcpu.py). A training loop
  that keeps every core busy is never scrubbed under (its chunks are still verified whenever
  they are read: restore, promotion, replication).

Damage found is journaled (``scrub_damage``: tier, chunk, steps, error, quarantined) and logged
as a warning, and what was read, every :data:`REPORT_S` (``scrubbed``: tier, bytes, chunks,
seconds); the store's read quarantined the chunk, so the next save of a state holding its
bytes writes them again. Remote tiers are not scrubbed here: each read is a billed request,
objects are replaced whole, and their reads (restore, promotion) verify every chunk anyway.

Under torch.distributed every tier is scrubbed by exactly one process (``owned``): a memory
tier every rank shares and the disk tier by rank 0, a node-local memory tier (peer
replication) by its node's leader, which journals its damage (the journal carries its rank);
the other ranks of a node leave it alone. A node tier holds only its node's chunks and
replicas: a chunk absent there is not damage (store/scrub.py ``partial``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from flashckpt.engine.tiers.build import Tier
from flashckpt.errors import FlashCkptError
from flashckpt.journal import Journal
from flashckpt.store.scrub import Scrubber, ScrubDamage

if TYPE_CHECKING:
    from flashckpt.engine.tiers.tierset import TierSet

log = logging.getLogger(__name__)

QUIET_S = 2.0  # after a save or promotion, the scrub waits this long (tests lower it)
STEP_S = 0.5  # bytes read per step: this many seconds at the rate
POLL_S = 0.5  # how often a scrub held back by a save in flight looks again
PAUSE_S = 5.0  # after a saturated host, an empty tier or an unreadable one
REPORT_S = 600.0  # what each tier's scrub read is journaled (``scrubbed``) at most this often


class IdleScrub:
    """The scrub of a Checkpointer's local tiers; call it when idle, it returns how many
    seconds until it wants to be called again. One thread calls it (the promoter's)."""

    def __init__(
        self,
        tiers: list[Tier],
        *,
        bytes_per_s: int,
        journal: Journal,
        busy: Callable[[], bool],
        saturated: Callable[[], bool],
    ) -> None:
        self.bytes_per_s = bytes_per_s
        self.journal = journal
        self._busy, self._saturated = busy, saturated
        self._cursors = [
            (t, Scrubber(t.store, partial=t.node_local)) for t in tiers if t.path is not None
        ]
        self._next = 0
        self._quiet_since: float | None = None
        self._read: dict[str, list[float]] = {}  # tier -> [bytes, chunks, seconds] unjournaled
        self._reported_at = time.monotonic()

    @property
    def enabled(self) -> bool:
        return self.bytes_per_s > 0 and bool(self._cursors)

    def activity(self) -> None:
        """A promotion just ran: stay quiet for a while."""
        self._quiet_since = None

    def __call__(self) -> float:
        now = time.monotonic()
        if self._busy():
            self._quiet_since = None
            return POLL_S
        if self._quiet_since is None:
            self._quiet_since = now
        if now - self._quiet_since < QUIET_S:
            return self._quiet_since + QUIET_S - now
        if self._saturated():
            return PAUSE_S
        tier, cursor = self._cursors[self._next % len(self._cursors)]
        self._next += 1
        try:
            res = cursor.step(max(1, int(self.bytes_per_s * STEP_S)))
        except FlashCkptError as exc:
            log.warning("scrub of the %s tier %s skipped: %s", tier.name, tier.url, exc)
            return PAUSE_S
        for damage in res.damaged:
            self._report(tier, damage)
        self._count(tier, res.bytes, res.checked, time.monotonic() - now)
        if res.checked == 0:  # nothing committed there yet: the next tier after a pause
            return PAUSE_S / len(self._cursors)
        return max(0.0, res.bytes / self.bytes_per_s - (time.monotonic() - now))

    def _count(self, tier: Tier, nbytes: int, chunks: int, seconds: float) -> None:
        """Add one step's reads; journal ``scrubbed`` per tier every :data:`REPORT_S`."""
        if chunks:
            got = self._read.setdefault(tier.name, [0.0, 0.0, 0.0])
            got[0] += nbytes
            got[1] += chunks
            got[2] += seconds
        if time.monotonic() - self._reported_at < REPORT_S:
            return
        self._reported_at = time.monotonic()
        for name, (b, n, secs) in sorted(self._read.items()):
            self.journal.append("scrubbed", tier=name, bytes=int(b), chunks=int(n), seconds=secs)
        self._read.clear()

    def _report(self, tier: Tier, d: ScrubDamage) -> None:
        self.journal.append(
            "scrub_damage",
            tier=tier.name,
            chunk=d.chunk,
            steps=list(d.steps),
            error=d.error,
            quarantined=d.quarantined,
        )
        log.warning(
            "scrub of the %s tier %s: chunk %s of steps %s is damaged: %s",
            tier.name,
            tier.url,
            d.chunk,
            list(d.steps),
            d.error,
        )


def start_idle_scrub(
    tiers: TierSet,
    *,
    bytes_per_s: int,
    busy: Callable[[], bool],
    saturated: Callable[[], bool],
    owned: Callable[[Tier], bool] | None = None,
) -> IdleScrub | None:
    """Hand the scrub of ``tiers``' local tiers to their promotion thread (None: it is off).
    ``owned(tier)``: whether this process is the one that scrubs ``tier`` (under
    torch.distributed each tier has one scrubber: distributed/runtime.py ``owns``); None: all."""
    mine = [t for t in tiers.tiers if owned is None or owned(t)]
    scrub = IdleScrub(
        mine, bytes_per_s=bytes_per_s, journal=tiers.journal, busy=busy, saturated=saturated
    )
    if not scrub.enabled:
        return None
    tiers.promoter.idle_work(scrub)
    return scrub
