"""At Checkpointer creation: do all ranks use the same root, and see the same directories?

The ranks commit one checkpoint together and rank 0 merges their parts, so every rank must open
the same root (the Store keys are derived from it, :mod:`flashckpt.dist.context`) and see the
same directory for each local tier. Each rank first records its root under a key of the process
group (``flashckpt/<group>/root/<rank>``); then rank 0 drops a marker file in each tier
directory and the others look for it. A directory that is node-local on a multi-node run (a
memory tier in /dev/shm, a root on a local disk) is a ConfigError on every rank, here rather
than at the first save. Ranks that opened different roots never meet in one barrier: after
``dist_timeout_s`` each of them reads the recorded roots and raises a ConfigError naming them.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from flashckpt.dist.context import DistContext
from flashckpt.errors import ConfigError, DistributedError


def check_shared(ctx: DistContext, dirs: Mapping[str, Path]) -> None:
    """Raise ConfigError on every rank unless all ranks share the root and ``dirs``."""
    roots_key = f"flashckpt/{ctx.group}/root"
    ctx.store.set(f"{roots_key}/{ctx.rank}", ctx.root.encode())
    barrier = ctx.barrier("shared-dirs")
    try:
        _markers(ctx, barrier, dirs)
    except DistributedError as exc:
        differ = _other_roots(ctx, roots_key)
        if differ:
            raise ConfigError(
                f"the ranks opened different checkpoint roots ({differ}): every rank must "
                "create its Checkpointer with the same root, on a filesystem every rank sees"
            ) from exc
        raise
    finally:
        ctx.finished(barrier)


def _other_roots(ctx: DistContext, roots_key: str) -> str:
    roots: dict[int, str] = {}
    for r in range(ctx.world_size):
        key = f"{roots_key}/{r}"
        if ctx.store.check([key]):
            roots[r] = bytes(ctx.store.get(key)).decode()
    if len(set(roots.values())) <= 1:
        return ""
    return "; ".join(f"rank {r}: {root}" for r, root in sorted(roots.items()))


def _markers(ctx: DistContext, barrier: Any, dirs: Mapping[str, Path]) -> None:
    token, error = "", None
    if ctx.rank == 0:
        token = uuid.uuid4().hex
        try:
            for d in dirs.values():
                (d / f".flashckpt-shared-{token}").touch()
        except OSError as exc:
            error = f"rank 0 cannot write a marker in {exc.filename}: {exc.strerror}"
    try:
        token = barrier.exchange("mark", {"token": token, "error": error})[0]["token"]
        unseen = [
            name
            for name, d in dirs.items()
            if ctx.rank != 0 and not (d / f".flashckpt-shared-{token}").exists()
        ]
        seen = barrier.exchange("look", {"unseen": unseen, "error": error})
    finally:
        if ctx.rank == 0 and token:
            for d in dirs.values():
                try:
                    os.unlink(d / f".flashckpt-shared-{token}")
                except OSError:
                    pass
    if seen[0]["error"]:
        raise ConfigError(seen[0]["error"])
    bad = {r: v["unseen"] for r, v in enumerate(seen) if v["unseen"]}
    if bad:
        what = "; ".join(
            f"rank {r} cannot see rank 0's {', '.join(f'{n} tier {dirs[n]}' for n in names)}"
            for r, names in bad.items()
        )
        raise ConfigError(
            f"checkpoint directories are not shared by all ranks ({what}). Under "
            "torch.distributed the root must be on a filesystem every rank sees, and a "
            "memory_tier (e.g. /dev/shm) works only when all ranks run on one node; "
            "drop memory_tier= on multi-node runs"
        )
