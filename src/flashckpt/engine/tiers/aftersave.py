"""What follows a durable save: its promotion to the slower tiers, then the save tier's
retention and garbage collection.

Retention deletes older checkpoints' files (0.2 s for a 123 MiB state on ext4, half a
synchronous save), so it runs on the staging thread, never on the caller's: an async save's
durable callback is already there; a synchronous save (``later=True``) returns once durable and
its retention follows while training runs. The next save, ``wait()``, ``steps()`` and
``close()`` wait for it (:meth:`AfterSave.wait`), so at most one is pending and the tier's space
is freed before the next save picks a tier. Failures are logged, never raised: the step is
durable, and the next save's retention tries again.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

from flashckpt.errors import FlashCkptError

if TYPE_CHECKING:
    from flashckpt.engine.tiers.build import Tier
    from flashckpt.engine.tiers.promote import PromoteTask
    from flashckpt.engine.tiers.tiercopy import Fresh
    from flashckpt.engine.tiers.tierset import TierSet
    from flashckpt.store.format.manifest import Manifest

log = logging.getLogger(__name__)


class AfterSave:
    """Promotion + retention of each durable step, on the Checkpointer's staging thread."""

    def __init__(self, tiers: TierSet, stager: ThreadPoolExecutor) -> None:
        self._tiers = tiers
        self._stager = stager
        self._pending: Future[None] | None = None  # a synchronous save's retention, running

    def __call__(
        self,
        step: int,
        tier: Tier,
        manifest: Manifest | None = None,
        *,
        later: bool = False,
        fresh: Fresh | None = None,
    ) -> PromoteTask | None:
        """Queue ``step``'s promotion (``manifest`` None: read back), then apply ``tier``'s
        retention: now (on the staging thread already), or ``later`` on it. Returns the
        promotion queued, if any. ``fresh`` (the pages the save kept mapped) goes to that
        promotion, or is closed here when none was queued."""
        task = None
        try:
            task = self._tiers.committed(step, tier, manifest, fresh=fresh)
        except FlashCkptError as exc:
            log.warning("promotion after step %d not queued: %s", step, exc)
        finally:
            if task is None and fresh is not None:
                fresh.close()
        if later:
            self._pending = self._stager.submit(self._retain, step, tier)
        else:
            self._retain(step, tier)
        return task

    def _retain(self, step: int, tier: Tier) -> None:
        try:
            self._tiers.retain(tier)
        except FlashCkptError as exc:
            log.warning("retention after step %d failed: %s", step, exc)

    def wait(self) -> None:
        """Wait for the retention a synchronous save left running."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()  # _retain logs its errors, never raises

    def settle(self) -> None:
        """Wait for everything queued on the staging thread (a sync save's retention, an
        async save's durable callback)."""
        self._stager.submit(lambda: None).result()
