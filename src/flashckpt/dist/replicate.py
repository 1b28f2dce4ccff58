"""Peer replication of a node-local memory tier (foundation: the interface; rounds follow)."""

from __future__ import annotations

from typing import Any

from flashckpt.journal import Journal
from flashckpt.policy.retention import RetentionPolicy
from flashckpt.store.manifest import Manifest


class Replicator:
    def __init__(self, runtime: Any, *, tiers: Any, memory: Any, journal: Journal) -> None:
        self.runtime = runtime
        self.tiers = tiers
        self.memory = memory
        self.journal = journal
        self.broken = False

    def published(self, part: Manifest) -> None:
        """A step was published in the node-local memory tier (called on the save thread)."""

    def retention(self, inner: RetentionPolicy) -> RetentionPolicy:
        return inner

    def drain(self) -> None:
        """Wait until every queued step is replicated or given up."""

    def stop(self) -> None:
        """Finish the round in progress and stop."""
