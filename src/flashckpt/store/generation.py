"""The root's run generation: ``ROOT/generation``, a durable counter every writer takes once.

Each writer of a root (a Checkpointer opening it for writing; under torch.distributed rank 0
for every rank) takes ``generation = previous + 1`` while it holds the root's writer lock, and
records it in every manifest it writes (:mod:`flashckpt.store.format.lineage`). The file is
``{"version": 1, "generation": N}``, written through a temporary file, fsync and an atomic rename,
the directory fsynced after (a generation handed out is never handed out again after a crash).

Hostile or damaged files follow the store's rules: a symlink, FIFO or directory at the name is
never followed or read (the gateway refuses it), a file larger than a few KiB is not read, and a
file that is not such a document is refused with a :class:`~flashckpt.errors.ConfigError` that
names it and says what to do. A missing file means a root written before generations existed (or
a new root): the counter then continues above the newest generation the root's own manifests
record, so removing a damaged file never makes a new run look older than an earlier one.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path

from flashckpt.errors import ConfigError, FlashCkptError
from flashckpt.store.files import safeopen
from flashckpt.store.files.jsonfile import load_object
from flashckpt.store.format.lineage import MAX_GENERATION

log = logging.getLogger(__name__)

GENERATION_NAME = "generation"
MAX_GENERATION_FILE_BYTES = 4096


def read_generation(root: Path) -> int | None:
    """The last generation taken in ``root`` (None: no ``ROOT/generation`` yet)."""
    where = root / GENERATION_NAME
    try:
        data = safeopen.read_file(root, GENERATION_NAME, max_bytes=MAX_GENERATION_FILE_BYTES)
    except FileNotFoundError:
        return None
    except (FlashCkptError, OSError) as exc:
        raise ConfigError(
            f"{where} is unreadable ({exc}); it must be a regular file holding the root's run "
            "generation. Remove it: the next writer continues above the newest generation its "
            "manifests record"
        ) from None
    try:
        doc = load_object(data, where=str(where), max_bytes=MAX_GENERATION_FILE_BYTES)
    except FlashCkptError as exc:
        raise ConfigError(f"{exc}; {where} is damaged: remove it") from None
    gen = doc.get("generation")
    if doc.get("version") != 1 or type(gen) is not int or not 0 <= gen < MAX_GENERATION:
        raise ConfigError(
            f"{where} does not hold a run generation ({{'version': 1, 'generation': N}}); it is "
            "damaged: remove it (the next writer continues above the newest generation its "
            "manifests record)"
        )
    return gen


def take_generation(root: Path, *, floor: Callable[[], int] | None = None) -> int:
    """Take the next generation of ``root`` (the caller holds the root's writer lock): one more
    than the recorded one; without a file, one more than ``floor()`` (the newest generation the
    root's own manifests record: :func:`flashckpt.store.lineage.newest_recorded`)."""
    last = read_generation(root)
    if last is None:
        last = floor() if floor is not None else 0
    gen = last + 1
    doc = f'{{"version": 1, "generation": {gen}}}\n'.encode()
    safeopen.write_file_atomic(root, GENERATION_NAME, doc, fsync=True)
    dfd = safeopen.open_dir(root)
    try:
        os.fsync(dfd)
    except OSError as exc:  # the rename may be lost at a power cut: said, not fatal
        log.warning("could not fsync %s after writing %s: %s", root, GENERATION_NAME, exc)
    finally:
        os.close(dfd)
    return gen
