"""The directories ``flashckpt chaos`` writes: it deletes only what it created.

Every directory the benchmark creates (its ``--dir`` when it did not exist, and one per method
and for the baseline inside it) gets a marker file, :data:`MARKER`. A later run may empty and
reuse a marked directory; a directory or ``chaos.json`` it did not create is the user's: the run
refuses before anything starts, naming it, instead of deleting it.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterable
from pathlib import Path

from flashckpt.errors import ConfigError

MARKER = ".flashckpt-chaos"
RESULT = "chaos.json"
RESULT_MARKER = ".flashckpt-chaos-result"  # in a --dir the user had: chaos.json is the run's


def is_ours(d: Path) -> bool:
    """True when ``d`` is a directory this benchmark created (it holds the marker file)."""
    return d.is_dir() and not d.is_symlink() and (d / MARKER).is_file()


def _refuse(path: Path, out: Path) -> ConfigError:
    return ConfigError(
        f"flashckpt chaos: {path} exists and was not created by flashckpt chaos (no {MARKER} "
        f"in it); it is never deleted or overwritten. Move it away, or pass another --dir "
        f"than {out}"
    )


def check_out(out: Path, names: Iterable[str]) -> None:
    """Refuse (ConfigError, before anything runs) when ``out`` already holds something the run
    would delete or overwrite and did not create: a subdirectory of one of ``names`` or a
    ``chaos.json`` in a directory that is not marked."""
    if out.exists() and not out.is_dir():
        raise ConfigError(f"flashckpt chaos: --dir {out} is not a directory")
    for name in names:
        d = out / name
        if (d.exists() or d.is_symlink()) and not is_ours(d):
            raise _refuse(d, out)
    result = out / RESULT
    ours = is_ours(out) or (out / RESULT_MARKER).is_file()
    if (result.exists() or result.is_symlink()) and not ours:
        raise _refuse(result, out)


def make_out(out: Path) -> None:
    """Create ``out`` (marked) when it does not exist. An existing one is only written into
    (its ``chaos.json``, marked as the run's by :data:`RESULT_MARKER`), never marked as
    created by the run, so no later run deletes it."""
    if not out.exists():
        out.mkdir(parents=True)
        (out / MARKER).write_text("created by flashckpt chaos\n")
    elif not is_ours(out):
        (out / RESULT_MARKER).write_text("chaos.json here is written by flashckpt chaos\n")


def fresh(d: Path) -> Path:
    """``d`` as a new, empty, marked directory: a marked one is emptied, anything else there
    is refused (check_out already refused it, unless it appeared since)."""
    if d.exists() or d.is_symlink():
        if not is_ours(d):
            raise _refuse(d, d.parent)
        shutil.rmtree(d)
    d.mkdir(parents=True)
    (d / MARKER).write_text("created by flashckpt chaos\n")
    return d
