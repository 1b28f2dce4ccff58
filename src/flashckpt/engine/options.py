"""Checkpointer options, validated once with messages that say what to do."""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass

from flashckpt.errors import ConfigError
from flashckpt.units import parse_bytes

ON_BUSY = ("wait", "skip")


@dataclass(frozen=True, kw_only=True)
class Options:
    async_save: bool = False
    incremental: bool = True
    compression: str | None = None
    host_memory_budget_bytes: int = 4 << 30
    chunk_bytes: int = 32 << 20
    pack_bytes: int = 4 << 20
    pack_threshold_bytes: int = 1 << 20
    persist_workers: int = 0  # 0: choose from the CPU count
    read_workers: int = 0
    on_busy: str = "wait"
    overlap: bool = True
    fsync: bool = True
    direct_io: bool = True
    governor: bool = True  # engine/runtime/governor.py: background or foreground, measured
    save_budget_s: float | None = None  # what a save may cost the loop (None: a sync save's)
    # idle re-hashing of the local tiers' committed chunks (engine/tiers/scrubbing.py); 0: off
    scrub_bytes_per_s: int = 64 << 20

    def __post_init__(self) -> None:
        b = self.save_budget_s
        if b is not None and (
            isinstance(b, bool) or not isinstance(b, (int, float)) or not math.isfinite(b) or b < 0
        ):
            raise ConfigError(
                f"save_budget_s must be a number of seconds >= 0 or None (None: what a "
                f"synchronous save of the same state costs, measured), got {b!r}"
            )
        for name in ("async_save", "incremental", "overlap", "fsync", "direct_io", "governor"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.compression not in (None, "zstd"):
            raise ConfigError(f"compression={self.compression!r}: use None or 'zstd'")
        if self.on_busy not in ON_BUSY:
            raise ConfigError(f"on_busy={self.on_busy!r}: use one of {ON_BUSY}")
        if self.chunk_bytes < 4096:
            raise ConfigError(f"chunk_bytes={self.chunk_bytes} is too small; use at least 4KiB")
        if self.host_memory_budget_bytes < 1 << 20:
            raise ConfigError("host_memory_budget must be at least 1MiB")
        r = self.scrub_bytes_per_s
        if isinstance(r, bool) or not isinstance(r, int) or r < 0:
            raise ConfigError(
                f"scrub_bytes_per_s must be a byte rate >= 0 such as '64MiB' (0 turns the idle "
                f"scrub off), got {r!r}"
            )
        for name in ("persist_workers", "read_workers"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 0:
                raise ConfigError(f"{name} must be an int >= 0 (0 = automatic), got {v!r}")

    @classmethod
    def build(
        cls,
        *,
        host_memory_budget: int | str,
        chunk_size: int | str,
        scrub_bytes_per_s: int | str = 64 << 20,
        **kw: object,
    ) -> Options:
        budget = parse_bytes(host_memory_budget, name="host_memory_budget")
        chunk = parse_bytes(chunk_size, name="chunk_size")
        chunk = min(chunk, max(budget, 1))  # a staging slot must fit the budget
        scrub = parse_bytes(scrub_bytes_per_s, name="scrub_bytes_per_s")
        sizes = dict(host_memory_budget_bytes=budget, chunk_bytes=chunk, scrub_bytes_per_s=scrub)
        return cls(**sizes, **kw)  # type: ignore[arg-type]

    @property
    def workers(self) -> int:
        return self.persist_workers or max(2, min(8, (os.cpu_count() or 2) * 2))

    @property
    def readers(self) -> int:
        return self.read_workers or max(2, min(8, (os.cpu_count() or 2) * 2))


@dataclass(frozen=True, kw_only=True)
class Replication:
    """Peer replication of a node-local memory tier (``Checkpointer(replicas=...)``).

    ``replicas``: copies of each rank's memory-tier checkpoint kept on other nodes (0: none;
    1: one peer, a ring over the nodes). ``placement``: ``placement(rank) -> node name`` when
    torchrun's ``GROUP_RANK`` or the host name does not tell the nodes apart. ``inflight_bytes``:
    the most chunk bytes one rank has in flight to its peer (and from its source) at once.
    ``timeout_s``: how long the side group's send/receive may wait for a peer before the
    replication is given up (``replication_failed``; gloo groups do not recover).
    """

    replicas: int = 1
    placement: Callable[[int], str] | None = None
    inflight_bytes: int = 64 << 20
    timeout_s: float = 120.0

    def __post_init__(self) -> None:
        if not isinstance(self.replicas, int) or isinstance(self.replicas, bool):
            raise ConfigError(f"replicas must be 0 or 1, got {self.replicas!r}")
        if self.replicas not in (0, 1):
            raise ConfigError(
                f"replicas={self.replicas}: only replicas=0 (none) or 1 (one peer on another "
                "node) are supported"
            )
        if self.placement is not None and not callable(self.placement):
            raise ConfigError("placement must be a function placement(rank) -> node name")
        if not isinstance(self.inflight_bytes, int) or self.inflight_bytes < 1 << 16:
            raise ConfigError("Replication.inflight_bytes must be an int of at least 64KiB")
        if not isinstance(self.timeout_s, (int, float)) or self.timeout_s <= 0:
            raise ConfigError(f"Replication.timeout_s must be > 0, got {self.timeout_s!r}")

    @classmethod
    def of(
        cls, replicas: int | Replication | None, placement: Callable[[int], str] | None = None
    ) -> Replication | None:
        """``replicas=`` as given to the Checkpointer; None when replication is off."""
        if isinstance(replicas, Replication):
            rep = replicas
        else:
            rep = cls(replicas=0 if replicas is None else replicas, placement=placement)
        return rep if rep.replicas > 0 else None


MAX_STEP = 10**15 - 1
"""The largest step a manifest name can hold (``steps/<at most 15 digits>.json``)."""


def check_step(step: object) -> int:
    """``step`` when it is an int in 0..MAX_STEP, else a ConfigError saying why."""
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ConfigError(f"step must be an int >= 0, got {step!r}")
    if step > MAX_STEP:
        raise ConfigError(
            f"step {step} is too large: checkpoint steps go up to {MAX_STEP} (15 digits); "
            "count optimizer steps, not samples or tokens"
        )
    return step
