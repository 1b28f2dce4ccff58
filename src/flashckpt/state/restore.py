"""Restore: match a checkpoint's tensors to the user's live state and load it in place.

Planning happens before any byte is read: every top-level entry and tensor is matched against
the target, and any mismatch (missing or unexpected keys, shapes) is reported together in one
:class:`~flashckpt.errors.StateMismatchError`. Tensors are then read straight into the target's
own storage where dtype and shape allow (no second copy of the checkpoint in memory), and each
Stateful object gets ``load_state_dict`` with a tree made of those tensors. Keys are matched
without torch.compile's ``_orig_mod.`` and handed back under the target's own names
(state/compiled.py), so compiled and plain models restore each other's checkpoints. An
optimizer's state saved keyed by parameter name (DCP's form) loads into a plain optimizer
(state/optim_names.py).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from flashckpt.errors import FlashCkptError, ManifestError, StateMismatchError
from flashckpt.state.capture import check_state, is_stateful
from flashckpt.state.compiled import canonical, canonical_key, prefix_hint, rekey_like
from flashckpt.state.dtensor import is_dtensor, local_shard
from flashckpt.state.optim_names import by_id, check_param_groups
from flashckpt.state.tree import decode_tree, tensor_leaves, tensor_refs
from flashckpt.store.format.dtypes import torch_dtype
from flashckpt.store.format.manifest import Manifest, TensorEntry

log = logging.getLogger(__name__)
_MAX_LISTED = 20


@dataclass(kw_only=True)
class Target:
    """Where one saved tensor goes: ``dest`` (a local tensor to fill, or None to allocate) and
    the box of the global tensor it covers."""

    entry: TensorEntry
    dest: torch.Tensor | None
    offset: tuple[int, ...]
    shape: tuple[int, ...]
    value: Any = None  # what load_state_dict receives (the DTensor/ndarray itself when in place)


@dataclass(kw_only=True)
class RestorePlan:
    state: Mapping[str, Any]
    trees: dict[str, Any]
    targets: dict[str, Target] = field(default_factory=dict)
    skipped: dict[str, set[str]] = field(default_factory=dict)  # canonical key paths
    raws: dict[str, Any] = field(default_factory=dict)  # each target's own state_dict()
    hints: list[str] = field(default_factory=list)
    strict: bool = True

    @property
    def nbytes(self) -> int:
        return sum(math.prod(t.shape) * t.entry.itemsize for t in self.targets.values())

    def finish(self, loaded: Mapping[str, Any]) -> None:
        """Hand the loaded tensors to their owners (``loaded[key]`` from the engine)."""

        skipped = set().union(*self.skipped.values()) if self.skipped else set()

        def lookup(kind: str, key: str) -> Any:
            if canonical_key(key) in skipped and key not in loaded:
                return None  # strict=False: not read, filtered out by _deliver
            if key not in loaded:
                raise ManifestError(f"state tree references unknown tensor {key!r}")
            return loaded[key]

        for name, value in self.state.items():
            if self.trees.get(name) is None:
                continue
            decoded = decode_tree(self.trees[name], lookup)
            if isinstance(value, torch.optim.Optimizer):  # FQN-keyed (DCP) state: by id
                decoded = by_id(decoded, value, self.state, entry=name)
            raw = self.raws.get(name, value)
            skipped_here = self.skipped.get(name, set())
            _deliver(self.state, name, value, raw, decoded, skipped_here, self.strict)


def plan_restore(
    state: Mapping[str, Any], manifest: Manifest, *, strict: bool = True, rank: int = 0
) -> RestorePlan:
    trees = dict(manifest.tree)
    trees.update(manifest.rank_trees.get(str(rank), {}))
    trees = {name: canonical(tree, name) for name, tree in trees.items()}  # older checkpoints
    plan = RestorePlan(state=check_state(state), trees=trees, strict=strict)
    problems: list[str] = []
    for name, value in plan.state.items():
        if name not in trees:
            problems.append(f"{name} (not in the checkpoint)")
            continue
        problems += _plan_entry(plan, manifest, name, value)
    if problems and strict:
        shown = problems[:_MAX_LISTED]
        more = f" and {len(problems) - _MAX_LISTED} more" if len(problems) > _MAX_LISTED else ""
        hints = "".join(f" Hint: {h}." for h in plan.hints)
        raise StateMismatchError(
            f"checkpoint step {manifest.step} does not match the state: {'; '.join(shown)}{more}."
            f"{hints} Pass strict=False to load what matches.",
            keys=[p.split(" ", 1)[0] for p in problems],
        )
    for name in [n for n in plan.state if n not in trees]:
        log.warning("restore: %r is not in checkpoint step %d; left as it is", name, manifest.step)
        plan.trees[name] = None
    return plan


def _plan_entry(plan: RestorePlan, manifest: Manifest, name: str, value: Any) -> list[str]:
    if isinstance(value, torch.optim.Optimizer):  # names that match no parameter: raise now
        by_id(plan.trees[name], value, plan.state, entry=name)
        check_param_groups(plan.trees[name], value, plan.state, entry=name)
    plan.raws[name] = target_raw = value.state_dict() if is_stateful(value) else value
    live = tensor_leaves(canonical(target_raw, name), name)  # canonical key paths
    saved = tensor_refs(plan.trees[name])  # stored paths (older versions kept "_orig_mod.")
    stored = {canonical_key(k): k for _, k in saved}
    problems: list[str] = []
    skipped: set[str] = set()
    for kind, key in saved:
        entry = manifest.tensors.get(key)
        if entry is None or entry.kind != kind:
            raise ManifestError(f"step {manifest.step}: state tree names missing tensor {key!r}")
        target = live.get(canonical_key(key))
        problem = _shape_problem(key, entry, target)
        if problem:
            problems.append(problem)
            skipped.add(canonical_key(key))
            target = None
        plan.targets[key] = _target(entry, target)
    if isinstance(value, torch.nn.Module):
        missing = sorted(set(live) - set(stored))
        unexpected = sorted(set(stored) - set(live))
        problems += [f"{k} (missing from the checkpoint)" for k in missing]
        problems += [f"{k} (in the checkpoint, not in the model)" for k in unexpected]
        skipped |= set(missing) | set(unexpected)
        for key in unexpected:  # never read bytes nobody will receive
            plan.targets.pop(stored[key], None)
        hint = prefix_hint(missing, unexpected)
        if hint is not None:
            plan.hints.append(hint)
    plan.skipped[name] = skipped
    return problems


def _shape_problem(key: str, entry: TensorEntry, target: Any) -> str | None:
    if target is None:
        return None
    tshape = tuple(target.shape)
    if tshape != entry.global_shape:
        return f"{key} (checkpoint shape {list(entry.global_shape)}, target shape {list(tshape)})"
    return None


_PLAIN = (torch.Tensor, torch.nn.Parameter, torch.nn.Buffer)  # never a DTensor (a subclass)


def _target(entry: TensorEntry, live: Any) -> Target:
    if type(live) in _PLAIN and entry.kind == "torch" and live.dtype == torch_dtype(entry.dtype):
        # the common case, without the DTensor geometry: the whole tensor, filled in place
        dest = live.detach() if live.requires_grad else live
        return Target(
            entry=entry, dest=dest, offset=(0,) * live.dim(), shape=entry.global_shape, value=live
        )
    full = (0,) * len(entry.global_shape)
    if isinstance(live, np.ndarray):  # arrays are small (RNG states): load, then np.copyto
        return Target(entry=entry, dest=None, offset=full, shape=entry.global_shape)
    if isinstance(live, torch.Tensor) and entry.kind == "torch":
        local, _, offset, _ = local_shard(live, entry.key)
        if is_dtensor(live) or local.dtype == torch_dtype(entry.dtype):
            return Target(
                entry=entry,
                dest=local.detach(),
                offset=offset,
                shape=tuple(local.shape),
                value=live,
            )
    return Target(entry=entry, dest=None, offset=full, shape=entry.global_shape)


def _deliver(
    state: Mapping[str, Any],
    name: str,
    value: Any,
    raw: Any,
    decoded: Any,
    skipped: set[str],
    strict: bool,
) -> None:
    if isinstance(value, torch.nn.Module) and skipped:
        decoded = {k: v for k, v in decoded.items() if f"{name}/{k}" not in skipped}
    decoded = rekey_like(decoded, raw)  # the target's own names ('_orig_mod.' when compiled)
    if is_stateful(value):
        if isinstance(value, torch.nn.Module):
            value.load_state_dict(decoded, strict=strict and not skipped)
        elif skipped:
            log.warning("restore: %r skipped (mismatched tensors, strict=False)", name)
        else:
            try:
                value.load_state_dict(decoded)
            except FlashCkptError:
                raise
            except KeyError as exc:  # the object wants a key the checkpoint lacks: one error
                key = exc.args[0] if exc.args else "?"
                raise StateMismatchError(
                    f"restore: {name!r}.load_state_dict wants key {key!r}, which "
                    f"checkpoint entry {name!r} does not hold (saved keys: "
                    f"{sorted(map(str, decoded))[:5]}...); save and restore the same kind "
                    "of object",
                    keys=[f"{name}/{key}"],
                ) from None
            except Exception as exc:  # torch's ValueError, a user object's own check: one error
                raise StateMismatchError(
                    f"restore: {name!r}.load_state_dict refused checkpoint entry {name!r} "
                    f"({type(exc).__name__}: {str(exc)[:300]}); the tensors of the state were "
                    "already loaded in place, so do not train on it: re-create the objects and "
                    "restore into ones built like those that were saved (or leave this entry "
                    "out of the state)",
                    keys=[name],
                ) from exc
    elif isinstance(value, torch.Tensor):
        if decoded is not value:
            with torch.no_grad():
                value.copy_(decoded)
    elif isinstance(value, np.ndarray) and isinstance(decoded, np.ndarray):
        if decoded is not value:
            np.copyto(value, decoded)
    elif isinstance(state, MutableMapping):
        state[name] = decoded
    else:
        raise StateMismatchError(
            f"cannot restore plain value {name!r} into a read-only mapping; pass a dict",
            keys=[name],
        )
