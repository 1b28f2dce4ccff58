"""One committed step read back as the nested Python state it was saved from (for exporters).

:func:`load_step` rebuilds each top-level state entry from the manifest's JSON tree with its
torch tensors read whole (shards merged) on CPU: ``{"model": {fqn: tensor}, "optim": {"state":
{0: {...}}, "param_groups": [...]}, "epoch": 3}``. Entries that hold NumPy arrays (``RNG``) are
left out: no export format outside flashckpt carries them.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from flashckpt.errors import ConfigError, NoCheckpointError
from flashckpt.state.tree import decode_tree, tensor_refs
from flashckpt.store.format.manifest import Manifest
from flashckpt.store.store import CheckpointStore

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class SavedStep:
    """A step as exporters need it: ``entries`` are the decoded state entries."""

    root: str
    step: int
    manifest: Manifest
    entries: dict[str, Any]


def open_root(root: str | os.PathLike[str]) -> CheckpointStore:
    """The store at ``root`` (read only); ConfigError when it is not a checkpoint root."""
    from flashckpt.store.files.backend import LocalBackend

    path = Path(root).expanduser()
    if not (path / "steps").is_dir():
        raise ConfigError(f"{root} is not a flashckpt checkpoint root (no steps/ directory)")
    return CheckpointStore(LocalBackend(path, create=False))


def pick(store: CheckpointStore, root: str | os.PathLike[str], step: int | None) -> int:
    steps = store.steps()
    if not steps:
        raise NoCheckpointError(f"{root} holds no checkpoint")
    if step is None:
        return steps[-1]
    if step not in steps:
        raise NoCheckpointError(f"step {step} is not in {root}; steps: {steps}")
    return step


def load_step(root: str | os.PathLike[str], *, step: int | None = None) -> SavedStep:
    """Step ``step`` (newest when None) of ``root`` as decoded state entries."""
    from flashckpt.engine.restore.reader import read_tensors

    store = open_root(root)
    step = pick(store, root, step)
    manifest = store.load_manifest(step)
    trees = dict(manifest.rank_trees.get("0", {}))
    trees.update(manifest.tree)
    wanted: dict[str, Any] = {}
    for name, tree in trees.items():
        refs = tensor_refs(tree)
        if any(kind != "torch" for kind, _ in refs):
            log.info("export: leaving out entry %r of step %d (holds NumPy arrays)", name, step)
            continue
        wanted[name] = tree
    keys = [key for tree in wanted.values() for _, key in tensor_refs(tree)]
    tensors = read_tensors(store, manifest, keys)

    def lookup(kind: str, key: str) -> Any:
        return tensors[key]

    entries = {name: decode_tree(tree, lookup) for name, tree in wanted.items()}
    return SavedStep(root=str(root), step=step, manifest=manifest, entries=entries)


def full_tensors(
    store: CheckpointStore, manifest: Manifest, prefix: str | None
) -> dict[str, torch.Tensor]:
    """Every torch tensor of a checkpoint, full (shards merged), on CPU."""
    from flashckpt.engine.restore.reader import read_tensors

    keys = [
        k
        for k, e in manifest.tensors.items()
        if e.kind == "torch" and (not prefix or k.startswith(prefix + "/"))
    ]
    loaded = read_tensors(store, manifest, keys)
    if prefix:
        return {k[len(prefix) + 1 :]: v for k, v in loaded.items()}
    return dict(loaded)


def rank_entries(saved: SavedStep, name: str) -> list[Any]:
    """Entry ``name`` as every rank but 0 saved it (a per-rank entry such as a dataloader's
    position lives in each rank's own tree); [] when no other rank holds one."""
    from flashckpt.engine.restore.reader import read_tensors

    trees = [
        t[name]
        for r, t in sorted(saved.manifest.rank_trees.items())
        if r != "0" and isinstance(t, dict) and name in t
    ]
    if not trees:
        return []
    keys = [key for tree in trees for kind, key in tensor_refs(tree) if kind == "torch"]
    tensors = read_tensors(open_root(saved.root), saved.manifest, keys)

    def lookup(kind: str, key: str) -> Any:
        return tensors.get(key)

    return [decode_tree(tree, lookup) for tree in trees]
