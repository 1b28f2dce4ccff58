"""The read side of the tier configuration: what ``ROOT/tiers.json`` records, and stores to
read each recorded tier (``flashckpt ls``, read-only restore). Nothing here writes."""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from flashckpt.engine.tiers import identity as tierid
from flashckpt.errors import ConfigError, FlashCkptError
from flashckpt.store.files.backend import LocalBackend
from flashckpt.store.store import CheckpointStore

log = logging.getLogger(__name__)

CONFIG_NAME = tierid.CONFIG_NAME
ORDER = ("memory", "local", "remote")


def public_url(url: str) -> str:
    """``url`` without any ``user:password@`` part (safe to write into tiers.json or logs)."""
    parts = urlsplit(url)
    if "@" not in parts.netloc:
        return url
    return urlunsplit(parts._replace(netloc=parts.netloc.rsplit("@", 1)[1]))


def read_config(root: str | os.PathLike[str]) -> dict[str, str]:
    """``{tier name: path or URL}`` recorded in ``root/tiers.json`` ({} when absent, or when
    the file is not one this user wrote: see :mod:`flashckpt.engine.tiers.identity`)."""
    p = Path(root)
    try:
        doc = tierid.read_trusted_config(p)
    except FlashCkptError as exc:
        log.warning("ignoring %s: %s", p / CONFIG_NAME, exc)
        return {}
    return {} if doc is None else {t["name"]: t["url"] for t in doc["tiers"]}


def open_tier_store(
    name: str, url: str, *, options: Mapping[str, Any] | None = None
) -> CheckpointStore:
    """A read-side store for a recorded tier (used by the CLI)."""
    if name == "remote":
        from flashckpt.store.files.remote import FsspecBackend

        return CheckpointStore(FsspecBackend(url, options=options))
    return CheckpointStore(LocalBackend(url, create=False))


def tier_stores(
    root: str | os.PathLike[str], *, memory_tier: str | None = None, remote: str | None = None
) -> tuple[list[tuple[str, CheckpointStore]], list[str]]:
    """``([(tier name, store), ...] fastest first, [problems])``: every tier a restore of
    ``root`` reads, as ``root/tiers.json`` records them (overridden by ``memory_tier`` /
    ``remote``). Read-only. A tier that cannot be opened or listed is left out and named in
    the problems (each also a warning); a recorded tier that is ``root`` itself is listed once."""
    p = Path(root).expanduser()
    cfg = read_config(p)
    if not cfg and not (p / "steps").is_dir():
        raise ConfigError(f"{root} is not a flashckpt checkpoint root (no steps/ or {CONFIG_NAME})")
    if memory_tier is None and "memory" in cfg and _same(Path(cfg["memory"]), p):
        del cfg["memory"]  # ROOT is the memory tier itself (flashckpt verify <memory tier>)
    if memory_tier is None and "memory" in cfg and not _recorded_tier_ok(p, Path(cfg["memory"])):
        del cfg["memory"]
    cfg["local"] = str(p)
    if memory_tier is not None:
        cfg["memory"] = memory_tier
    if remote is not None:
        cfg["remote"] = remote
    out: list[tuple[str, CheckpointStore]] = []
    problems: list[str] = []
    for name in ORDER:
        if name not in cfg:
            continue
        try:
            if name != "remote" and not Path(cfg[name]).is_dir():
                raise ConfigError("no such directory")
            store = open_tier_store(name, cfg[name])
            store.steps()
        except FlashCkptError as exc:
            problems.append(f"{name} tier {cfg[name]} is unavailable: {exc}")
            warnings.warn(problems[-1], stacklevel=2)
            continue
        out.append((name, store))
    return out, problems


def list_tiers(
    root: str | os.PathLike[str], *, memory_tier: str | None = None, remote: str | None = None
) -> dict[int, list[tuple[str, CheckpointStore]]]:
    """``{step: [(tier name, store), ...] fastest first}`` for the tiers of
    :func:`tier_stores` (an unreachable tier is reported with a warning and skipped)."""
    out: dict[int, list[tuple[str, CheckpointStore]]] = {}
    for name, store in tier_stores(root, memory_tier=memory_tier, remote=remote)[0]:
        try:
            steps = store.steps()
        except FlashCkptError as exc:
            warnings.warn(f"{name} tier {store.url} is unavailable: {exc}", stacklevel=2)
            continue
        for s in steps:
            out.setdefault(s, []).append((name, store))
    return out


def _same(a: Path, b: Path) -> bool:
    return os.path.normpath(a.absolute()) == os.path.normpath(b.absolute())  # no file access


def _recorded_tier_ok(root: Path, mem: Path) -> bool:
    """Whether the memory tier recorded in ``root/tiers.json`` passes the ownership and
    identity checks; if not, ``ls`` warns and does not look inside it."""
    try:
        tierid.check_tier_dir(mem)
        rid = tierid.find_root_id(root)
        if rid is None:
            raise ConfigError(f"{root} has no {tierid.ROOT_ID_NAME}, so {mem} cannot be its tier")
        tierid.check_belongs(mem, rid=rid, local_root=root.absolute())
    except FlashCkptError as exc:
        warnings.warn(f"not listing the memory tier recorded in {root}: {exc}", stacklevel=3)
        return False
    return True
