"""``flashckpt.restore(root, state)``: load a checkpoint without becoming a writer.

For an evaluation process next to a trainer that is still writing the root, and for a
read-only copy of a root (a snapshot, a mounted bucket, ``chmod -w``). It takes no lock and
writes nothing: no journal line, no run marker, no directory, no promotion. It reads the tiers
recorded in ``root/tiers.json`` (memory, local, remote; override with ``memory_tier=`` /
``remote=``), takes the copy of each step lineage chooses (store/lineage.py; a crashed run's
abandoned copy is skipped), fastest first, and loads the newest valid step like
:meth:`Checkpointer.restore`, with the same all-or-nothing rule.

A trainer's retention may delete a step while it is being read (its manifest first, then its
chunks). A chunk that vanished is damage only if its step is still listed: when the manifest is
gone too, the step was retired, not damaged; the reader lists the steps again and loads the
newest one, without a warning.
"""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from flashckpt.engine.restore.load import Attempt, backed, load_step, restore_newest
from flashckpt.engine.tiers.config import CONFIG_NAME, list_tiers
from flashckpt.errors import CorruptCheckpointError, NoCheckpointError, StorageError
from flashckpt.store.lineage import judge_held
from flashckpt.store.store import CheckpointStore, step_name

log = logging.getLogger(__name__)

_ROUNDS = 8  # times the steps are listed again after the step being read was retired
Copy = tuple[str, CheckpointStore]


class _Retired(Exception):
    """The step being read was deleted by the writer's retention (not damage)."""


def restore(
    root: str | os.PathLike[str],
    state: Mapping[str, Any],
    step: int | None = None,
    *,
    strict: bool = True,
    memory_tier: str | None = None,
    remote: str | None = None,
    readers: int = 4,
) -> int | None:
    """Load the newest valid checkpoint of ``root`` (or ``step``) into ``state``, read-only.

    Returns the step loaded, or None when the root holds no checkpoint (the state is then
    untouched). Raises :class:`CorruptCheckpointError` for a damaged explicit ``step``, and
    when no checkpoint loads after bytes already reached the live state.
    """
    p = Path(root).expanduser().absolute()
    if not (p / "steps").is_dir() and not (p / CONFIG_NAME).is_file():
        return None
    attempt = Attempt()
    holders: dict[int, list[Copy]] = {}

    def load(s: int, copy: Copy) -> None:
        load_step(
            state,
            s,
            copy[1],
            tier_name=copy[0],
            strict=strict,
            rank=0,
            readers=readers,
            journal=None,
            attempt=attempt,
            backed=backed(holders.get(s, []), copy),
        )

    for _ in range(_ROUNDS):
        # the copy of each step lineage says is the checkpoint (store/lineage.py), never a
        # crashed run's abandoned copy that a faster tier still holds
        holders, _ = judge_held(list_tiers(p, memory_tier=memory_tier, remote=remote), _store)
        try:
            return restore_newest(holders, step, load, _across_copies, attempt)
        except _Retired as gone:
            if step is not None:
                raise NoCheckpointError(
                    f"step {step} was deleted from {p} while reading it"
                ) from gone
            log.info("%s; listing the steps again", gone)
    raise NoCheckpointError(
        f"every step of {p} was deleted while it was being read ({_ROUNDS} times); the writer "
        "retires checkpoints faster than they can be read: retry, or keep more steps"
    )


def _store(copy: Copy) -> CheckpointStore:
    return copy[1]


def _across_copies(step: int, copies: list[Copy], load: Callable[[Copy], None]) -> Copy:
    """Load the fastest valid copy of ``step``; :class:`_Retired` when the step vanished."""
    if not copies:
        raise NoCheckpointError(f"no checkpoint for step {step} in any tier")
    error: BaseException | None = None
    for copy in copies:
        try:
            load(copy)
            return copy
        except (CorruptCheckpointError, StorageError, NoCheckpointError) as exc:
            if isinstance(exc, NoCheckpointError) or not _listed(copy[1], step):
                continue  # retired under us: not damage
            error = exc
            msg = f"step {step}: the {copy[0]} copy failed ({exc})"
            warnings.warn(msg, RuntimeWarning, stacklevel=4)
    if error is None:
        raise _Retired(f"step {step} was deleted by the writer's retention while being read")
    raise error


def _listed(store: CheckpointStore, step: int) -> bool:
    try:
        return store.backend.exists(step_name(step))
    except OSError:
        return True  # cannot tell: report the original error
