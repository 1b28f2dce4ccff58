"""Tier identity and ownership: a tier belongs to one root, and to the current user.

``/dev/shm`` is world-writable and memory-tier paths are predictable, so a tier directory may
have been made by someone else (another user planting a step for us to restore) or by another
run (whose checkpoints we would restore and promote into our root). Three rules:

1. Every checkpoint root has an id (``ROOT/root-id``: 32 hex digits, created once, atomically,
   by the first process that opens the root). Every local tier records it in its
   ``tiers.json`` (``"root_id"``); a tier recording another root's id is refused with a
   :class:`~flashckpt.errors.ConfigError` naming both.
2. A memory-tier directory is created mode 0700 by the current user; an existing one that is a
   symlink, not owned by the current user, or writable by group or others is refused.
3. A ``tiers.json`` is read only after those checks (and itself only if it is a regular file of
   the current user, not writable by others); ``flashckpt ls`` follows the memory and remote
   tiers it names only then.
"""

from __future__ import annotations

import errno
import os
import re
import stat
import uuid
from pathlib import Path
from typing import Any

from flashckpt.errors import ConfigError, FlashCkptError, StorageError
from flashckpt.store.files import safeopen
from flashckpt.store.files.jsonfile import load_object

ROOT_ID_NAME = "root-id"
CONFIG_NAME = "tiers.json"
_ID_RE = re.compile(r"^[0-9a-f]{32}$")
MAX_CONFIG_BYTES = 64 << 10


def owner_problem(path: Path, st: os.stat_result, what: str) -> str | None:
    """Why ``path`` (``st``: its lstat, or an fstat) cannot be trusted as this user's own: a
    symlink, another owner, or writable by group or others; None when it can."""
    if stat.S_ISLNK(st.st_mode):
        return f"{what} {path} is a symlink"
    if st.st_uid != os.geteuid():
        return f"{what} {path} is owned by uid {st.st_uid}, not by this user (uid {os.geteuid()})"
    if st.st_mode & 0o022:
        return f"{what} {path} is writable by group or others (mode {stat.S_IMODE(st.st_mode):o})"
    return None


def check_tier_dir(path: Path) -> None:
    """Refuse a memory-tier directory that is not a real directory of this user, mode 0700-ish
    (no write for group or others): someone else could plant or swap checkpoints in it."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise ConfigError(f"memory tier {path} does not exist") from None
    problem = owner_problem(path, st, "memory tier")
    if problem is None and not stat.S_ISDIR(st.st_mode):
        problem = f"memory tier {path} is not a directory"
    if problem:
        raise ConfigError(
            f"{problem}; refusing to use it (anyone who can write it could plant a checkpoint "
            "for this run to restore). Choose a memory_tier path of your own, e.g. "
            f"/dev/shm/<you>-<run>, or remove it and let flashckpt create it (mode 0700)"
        )


SHM = Path("/dev/shm")


def trust_anchor(path: Path) -> Path:
    """Where trust in a memory-tier path starts: /dev/shm itself for a path below it (anyone
    can write /dev/shm, so nothing below it is trusted unchecked), else the directory above
    the deepest ancestor that exists (what exists is checked, what is missing is created)."""
    if path.is_relative_to(SHM) and path != SHM:
        return SHM
    existing = path.parent
    while not os.path.lexists(existing) and existing != existing.parent:
        existing = existing.parent
    return existing.parent


def prepare_memory_dir(path: Path) -> None:
    """Create the memory-tier directory mode 0700, its missing parents 0700 too, then check
    it. Every ancestor from the trust anchor (:func:`trust_anchor`) down is opened without
    following a symlink and must be this user's or root's, not writable by others unless
    sticky (``safeopen.open_dir``): a /dev/shm/X planted by another user as a symlink, or as
    a world-writable directory in which the tier could be swapped, is refused."""
    path = Path(os.path.abspath(path))
    anchor = trust_anchor(path)
    rel = path.parent.relative_to(anchor).as_posix()
    try:
        dfd = safeopen.open_dir(anchor, "" if rel == "." else rel, create=True, mode=0o700)
    except StorageError as exc:
        raise ConfigError(f"memory tier {path}: {exc}") from None
    except OSError as exc:
        raise StorageError(f"cannot create memory tier {path}: {exc.strerror}") from exc
    try:
        os.mkdir(path.name, 0o700, dir_fd=dfd)
    except FileExistsError:
        pass
    except OSError as exc:
        raise StorageError(f"cannot create memory tier {path}: {exc.strerror}") from exc
    finally:
        os.close(dfd)
    check_tier_dir(path)


def find_root_id(root: Path) -> str | None:
    """The id of the checkpoint root ``root``; None when it has none yet."""
    try:
        return _read_id(root)
    except FileNotFoundError:
        return None


def ensure_root_id(root: Path, *, new: str | None = None) -> str:
    """The id of the checkpoint root ``root``, created (atomically, once) if it has none:
    ``new`` when given (a fresh root adopting the id of the run it continues), else random."""
    found = find_root_id(root)
    if found is not None:
        return found
    new = new or uuid.uuid4().hex
    tmp = f"{ROOT_ID_NAME}.tmp-{os.getpid()}-{new[:8]}"
    safeopen.write_file_atomic(root, tmp, f"{new}\n".encode())
    dfd = safeopen.open_dir(root)
    try:
        os.link(tmp, ROOT_ID_NAME, src_dir_fd=dfd, dst_dir_fd=dfd, follow_symlinks=False)
    except FileExistsError:
        pass  # another process (rank) created it first: its id wins
    except OSError as exc:  # no hard links here: a plain rename (last writer wins)
        if exc.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP):
            raise StorageError(f"cannot record the root id in {root}: {exc.strerror}") from exc
        safeopen.replace_in(dfd, tmp, ROOT_ID_NAME)
    finally:
        try:
            os.unlink(tmp, dir_fd=dfd)
        except OSError:
            pass
        os.close(dfd)
    return _read_id(root)


def _read_id(root: Path) -> str:
    try:
        text = safeopen.read_file(root, ROOT_ID_NAME, max_bytes=64).decode("ascii", "replace")
    except FlashCkptError as exc:
        raise ConfigError(f"{root / ROOT_ID_NAME} is unreadable ({exc}); remove it") from None
    rid = text.strip()
    if not _ID_RE.match(rid):
        raise ConfigError(
            f"{root / ROOT_ID_NAME} does not hold a root id (32 hex digits); it is damaged: "
            "remove it (a new id is created; memory tiers of the old one are then refused)"
        )
    return rid


def read_trusted_config(root: Path) -> dict[str, Any] | None:
    """``root/tiers.json`` as a validated document, or None when absent. Raises ConfigError
    when it is not a regular file of this user (not writable by others) or not a valid
    tiers document."""
    rel = CONFIG_NAME
    try:
        st = safeopen.lstat_in(root, rel)
    except FileNotFoundError:
        return None
    problem = owner_problem(root / rel, st, "tier config")
    if problem is None and not stat.S_ISREG(st.st_mode):
        problem = f"tier config {root / rel} is a {safeopen.kind_of(st.st_mode)}"
    if problem:
        raise ConfigError(f"{problem}; not trusting it")
    data = safeopen.read_file(root, rel, max_bytes=MAX_CONFIG_BYTES)
    doc = load_object(data, where=str(root / rel), max_bytes=MAX_CONFIG_BYTES, error=ConfigError)
    tiers = doc.get("tiers", [])
    if not isinstance(tiers, list) or not all(
        isinstance(t, dict) and isinstance(t.get("name"), str) and isinstance(t.get("url"), str)
        for t in tiers
    ):
        raise ConfigError(f"{root / rel}: 'tiers' must be a list of {{name, url}} strings")
    rid = doc.get("root_id")
    if rid is not None and not (isinstance(rid, str) and _ID_RE.match(rid)):
        raise ConfigError(f"{root / rel}: 'root_id' {rid!r} is not a root id")
    return doc


def check_belongs(tier: Path, *, rid: str, local_root: Path, name: str = "memory") -> None:
    """Refuse the tier at ``tier`` when its tiers.json says it belongs to another root."""
    doc = read_trusted_config(tier)
    if doc is None:
        return  # a new tier: this root claims it when it writes its tiers.json
    other = doc.get("root_id")
    recorded_local = next((t["url"] for t in doc["tiers"] if t["name"] == "local"), None)
    if other == rid:
        return
    if other is None and recorded_local in (None, str(local_root)):
        return  # written before root ids existed, by this root
    raise ConfigError(
        f"the {name} tier {tier} belongs to another checkpoint root (root id {other}, local "
        f"root {recorded_local}), not to {local_root} (root id {rid}); two runs must not share "
        f"a tier. Give this run its own {name} tier path, or remove {tier} if that run is over"
    )


def claim_remote(backend: Any, *, local_root: Path) -> None:
    """Rule 1 for a remote tier (an object store has no owner or mode to check): the tier
    holds ``root-id``. A new tier gets this root's id. A tier holding another root's id is
    refused with a ConfigError naming both, unless this root is fresh (it has no id yet): it
    then adopts the tier's id, because a new local root given a run's remote prefix is how a
    run continues after its local disk was lost (the remote is the copy that survived).
    (Two roots claiming one empty prefix at the same instant: the last write wins.)"""
    try:
        raw = backend.read(ROOT_ID_NAME)
    except FileNotFoundError:
        backend.put(ROOT_ID_NAME, [f"{ensure_root_id(local_root)}\n".encode()])
        return
    other = raw[:64].decode("ascii", "replace").strip()
    if not _ID_RE.match(other):
        raise ConfigError(
            f"{backend.url}/{ROOT_ID_NAME} does not hold a root id (32 hex digits); it is "
            "damaged: remove it if this remote prefix belongs to this run"
        )
    rid = ensure_root_id(local_root, new=other)
    if rid != other:
        raise ConfigError(
            f"the remote tier {backend.url} belongs to another checkpoint root (root id "
            f"{other}), not to {local_root} (root id {rid}); two runs must not share a tier. "
            "Give this run its own remote= prefix, or delete that prefix if its run is over"
        )
