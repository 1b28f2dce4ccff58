"""Opening the tiers of a Checkpointer: memory (``/dev/shm``) -> local disk -> remote, fastest
first, each a :class:`Tier` (its store, retention and writer lock).

The memory tier is checked before anything is written to it: a directory of this user, mode
0700, not a symlink, and bound to this root (its root id: another run's memory tier is never
restored). The remote's root id is claimed here when reachable, else before the first promotion
writes to it. :mod:`flashckpt.engine.tiers.tierset` runs them (placement, promotion, retention).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from flashckpt.engine.tiers import identity as tierid
from flashckpt.engine.tiers.config import public_url
from flashckpt.errors import StorageError
from flashckpt.policy.retention import KeepLast, RetentionPolicy, as_retention
from flashckpt.store.files.backend import LocalBackend
from flashckpt.store.lock import WriterLock
from flashckpt.store.store import CheckpointStore

log = logging.getLogger(__name__)


@dataclass(kw_only=True)
class Tier:
    name: str  # "memory", "local" or "remote"
    store: CheckpointStore
    keep: RetentionPolicy
    path: Path | None = None  # local tiers: the directory
    lock: WriterLock | None = field(default=None, repr=False)
    # remote tiers whose root id could not be checked at start (unreachable): checked before
    # the first promotion writes to them (a failure there is retried like the copy)
    unclaimed: Callable[[], None] | None = field(default=None, repr=False)
    # a memory tier of one node under peer replication (distributed/): holds the chunks of its
    # node's ranks and replicas only, so it is never promoted from here
    # (distributed/replication/replicate.py promotes)
    node_local: bool = False
    suspended: str | None = None  # why saves skip this tier now (replication stopped)

    def claim(self) -> None:
        if self.unclaimed is not None:
            self.unclaimed()
            self.unclaimed = None

    @property
    def url(self) -> str:
        return self.store.url


def build_tiers(
    *,
    local: CheckpointStore,
    local_root: Path,
    keep: RetentionPolicy,
    memory_tier: str | os.PathLike[str] | None,
    keep_memory: RetentionPolicy | int | None,
    remote: str | None,
    remote_options: Mapping[str, Any] | None,
    keep_remote: RetentionPolicy | int | None,
    fsync: bool,
    lock_name: str = "writer",
    check_shared: Callable[[dict[str, Path]], None] | None = None,
) -> list[Tier]:
    """The configured tiers, fastest first; the memory tier's writer lock (``lock_name``: one
    per rank under torch.distributed, like the root's) is taken here. ``check_shared`` (from
    the distributed runtime) may refuse local tier directories that not every rank sees."""
    tiers: list[Tier] = []
    try:
        _add_tiers(tiers, local, local_root, keep, memory_tier, keep_memory, fsync, lock_name)
        if remote is not None:
            from flashckpt.store.files.remote import FsspecBackend

            backend = FsspecBackend(remote, options=remote_options)
            tier = Tier(
                name="remote", store=CheckpointStore(backend), keep=as_retention(keep_remote)
            )
            tier.unclaimed = partial(tierid.claim_remote, backend, local_root=local_root)
            try:  # the remote's root id; an outage must not stop training from starting
                tier.claim()
            except (OSError, StorageError) as exc:
                log.warning(
                    "cannot check the root id of %s yet (%s); checked before the first "
                    "promotion to it",
                    public_url(remote),
                    exc,
                )
            tiers.append(tier)
        if check_shared is not None:
            check_shared({t.name: t.path for t in tiers if t.path is not None})
    except BaseException:
        release_locks(tiers)
        raise
    return tiers


def release_locks(tiers: list[Tier]) -> None:
    for t in tiers:
        if t.lock is not None:
            t.lock.release()


def _add_tiers(
    tiers: list[Tier],
    local: CheckpointStore,
    local_root: Path,
    keep: RetentionPolicy,
    memory_tier: str | os.PathLike[str] | None,
    keep_memory: RetentionPolicy | int | None,
    fsync: bool,
    lock_name: str,
) -> None:
    if memory_tier is not None:
        mem = Path(memory_tier).expanduser().absolute()
        if mem == local_root:
            raise StorageError(f"memory_tier {mem} is the checkpoint root itself; give /dev/shm/..")
        rid = tierid.ensure_root_id(local_root)
        tierid.prepare_memory_dir(mem)  # 0700, this user's, not a symlink
        lock = WriterLock(mem, name=lock_name)
        store = CheckpointStore(LocalBackend(mem, fsync=fsync))
        lock.acquire()
        try:
            tierid.check_belongs(mem, rid=rid, local_root=local_root)
        except BaseException:
            lock.release()
            raise
        keep_m = KeepLast(2) if keep_memory is None else as_retention(keep_memory)
        tiers.append(Tier(name="memory", store=store, keep=keep_m, path=mem, lock=lock))
    tiers.append(Tier(name="local", store=local, keep=keep, path=local_root))
