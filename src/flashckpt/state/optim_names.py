"""Optimizer state keyed by parameter name, restored into a plain ``torch.optim`` optimizer.

``torch.optim`` keys its state by integer ids (each parameter's position across
``param_groups``); DCP and ``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict``
key it by the parameter's FQN (``{"state": {"lin.weight": {...}}, "param_groups": [{"params":
["lin.weight", ...], "lr": ...}]}``), and so does a DCP checkpoint imported with ``flashckpt
import`` (its ``param_groups`` are DCP's pickled bytes, never read: the import has none).

:func:`by_id` turns such a tree into the id-keyed form ``optimizer.load_state_dict`` expects,
naming the optimizer's parameters through the modules restored with it
(``restore({"model": model, "optim": optimizer})``). Saved ``param_groups`` must group the same
parameters as the live ones; their hyperparameters are restored. Without saved groups the live
optimizer keeps its own (learning rate, betas, ...).

torchtitan's flat form (``{"state.<fqn>.exp_avg": t, "param_groups.<fqn>.lr": 0.01}``, what its
``OptimizersContainer.state_dict`` returns and its DCP checkpoints hold) restores as is into an
optimizer whose own ``state_dict`` has that form, and through :func:`unflat_optimizer` into a
plain one.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from flashckpt.errors import StateMismatchError
from flashckpt.state.compiled import canonical_key


def is_by_name(tree: Any) -> bool:
    """True for an optimizer state whose state and param_groups name parameters by FQN."""
    if not (isinstance(tree, Mapping) and isinstance(tree.get("state"), Mapping)):
        return False
    groups = tree.get("param_groups")
    if not isinstance(groups, list) or not all(isinstance(g, Mapping) for g in groups):
        return False
    params = [p for g in groups for p in g.get("params", [])]
    named = all(isinstance(k, str) for k in tree["state"]) and all(
        isinstance(p, str) for p in params
    )
    return named and (bool(tree["state"]) or bool(params) or not groups)


def is_flat_optimizer(value: Any) -> bool:
    """True for torchtitan's flat optimizer state (every key ``state.*`` or
    ``param_groups.*``)."""
    return (
        isinstance(value, Mapping)
        and bool(value)
        and all(isinstance(k, str) and k.startswith(("state.", "param_groups.")) for k in value)
    )


def flat_optimizer(by_name: Mapping[str, Any]) -> dict[str, Any]:
    """An FQN-keyed optimizer state (``{"state": {fqn: {...}}, "param_groups": [...]}``) in
    torchtitan's flat form."""
    out: dict[str, Any] = {}

    def put(prefix: str, value: Any) -> None:
        if isinstance(value, Mapping):
            for k, v in value.items():
                put(f"{prefix}.{k}", v)
        else:
            out[prefix] = value

    for fqn, per in by_name["state"].items():
        put(f"state.{fqn}", per)
    for group in by_name["param_groups"]:
        for fqn in group["params"]:
            for key, value in group.items():
                if key not in ("params", "param_names"):
                    out[f"param_groups.{fqn}.{key}"] = value
    return out


def unflat_optimizer(flat: Mapping[str, Any], groups: Sequence[Sequence[str]]) -> dict[str, Any]:
    """torchtitan's flat form back to FQN-keyed ``{"state", "param_groups"}``, grouped as
    ``groups`` (the live optimizer's parameter names per param group; a name may contain
    dots, so the longest name that prefixes a key wins)."""
    names = sorted((n for g in groups for n in g), key=len, reverse=True)
    state: dict[str, dict[str, Any]] = {}
    hyper: dict[str, dict[str, Any]] = {}
    for key, value in flat.items():
        kind, _, rest = key.partition(".")
        fqn = next((n for n in names if rest.startswith(n + ".")), None)
        if fqn is None:
            raise StateMismatchError(
                f"optimizer key {key!r} names no parameter of the optimizer; restore the model "
                "it was saved with",
                keys=[key],
            )
        leaf = rest[len(fqn) + 1 :]
        (state if kind == "state" else hyper).setdefault(fqn, {})[leaf] = value
    param_groups = [{**hyper.get(g[0], {}), "params": list(g)} for g in groups if g]
    return {"state": state, "param_groups": param_groups if hyper else []}


def param_names(state: Mapping[str, Any]) -> dict[int, str]:
    """``id(parameter) -> FQN`` over the modules of ``state`` (canonical names, first wins)."""
    names: dict[int, str] = {}
    for value in state.values():
        if isinstance(value, torch.nn.Module):
            for name, p in value.named_parameters():
                names.setdefault(id(p), canonical_key(name))
    return names


def check_param_groups(
    tree: Any, optimizer: torch.optim.Optimizer, state: Mapping[str, Any], *, entry: str
) -> None:
    """Raise StateMismatchError, before any byte of the checkpoint is read, when the saved
    ``param_groups`` (of the JSON ``tree``) do not group as many parameters, group by group, as
    ``optimizer``'s: ``torch.optim.Optimizer.load_state_dict`` would refuse them with a plain
    ValueError only after the rest of the state (the model's weights) was loaded in place."""
    from flashckpt.state.tree import decode_tree  # (the state tree, without any tensor)

    if is_flat_optimizer(optimizer.state_dict()):
        return  # torchtitan's container checks its own form
    saved = by_id(decode_tree(tree, lambda kind, key: None), optimizer, state, entry=entry)
    groups = saved.get("param_groups") if isinstance(saved, Mapping) else None
    if not isinstance(groups, list) or not all(isinstance(g, Mapping) for g in groups):
        return  # no groups saved (a DCP import): the optimizer keeps its own
    saved_sizes = [len(g.get("params", ())) for g in groups]
    live_sizes = [len(g["params"]) for g in optimizer.param_groups]
    if saved_sizes != live_sizes:
        raise StateMismatchError(
            f"checkpoint entry {entry!r} holds an optimizer with {len(saved_sizes)} param "
            f"groups of {saved_sizes} parameters, and the optimizer to restore into has "
            f"{len(live_sizes)} param groups of {live_sizes}: nothing was loaded. Build the "
            "optimizer with the same param groups as the run that saved it (or leave "
            f"{entry!r} out of the state to restore only the rest)",
            keys=[f"{entry}/param_groups"],
        )


def by_id(
    saved: Any, optimizer: torch.optim.Optimizer, state: Mapping[str, Any], *, entry: str
) -> Any:
    """``saved`` in ``optimizer``'s id-keyed form when it is keyed by name, else unchanged."""
    names: dict[int, str] | None = None
    live_sd = optimizer.state_dict()
    if is_flat_optimizer(live_sd):  # torchtitan's container: hand it its own flat form
        if not is_by_name(saved):
            return saved
        # the live hyperparameters where none were saved (a DCP import carries no groups)
        flat = {k: v for k, v in live_sd.items() if k.startswith("param_groups.")}
        flat.update(flat_optimizer(saved))
        return flat
    if is_flat_optimizer(saved):
        names = param_names(state)
        groups = [[names.get(id(p), "") for p in g["params"]] for g in optimizer.param_groups]
        saved = unflat_optimizer(saved, groups)
    if not is_by_name(saved):
        return saved
    names = names if names is not None else param_names(state)
    order = [p for g in optimizer.param_groups for p in g["params"]]
    fqns = [names.get(id(p)) for p in order]
    if None in fqns:
        raise StateMismatchError(
            f"checkpoint entry {entry!r} names optimizer parameters by FQN, and parameter "
            f"{fqns.index(None)} of the optimizer is in no module of the state: restore the "
            f"model with it, e.g. restore({{'model': model, {entry!r}: optimizer}})",
            keys=[entry],
        )
    index = {f: i for i, f in enumerate(fqns) if f is not None}
    unknown = sorted(set(saved["state"]) - set(index))
    if unknown:
        raise StateMismatchError(
            f"checkpoint entry {entry!r} holds optimizer state for {unknown[:5]}, which are not "
            "parameters of this optimizer (a different model?)",
            keys=[f"{entry}/state/{k}" for k in unknown],
        )
    live = live_sd["param_groups"]
    return {
        "state": {index[f]: v for f, v in saved["state"].items()},
        "param_groups": _groups(saved["param_groups"], live, index, entry),
    }


def _groups(
    saved: list[Any], live: list[dict[str, Any]], index: dict[str, int], entry: str
) -> list[dict[str, Any]]:
    if not saved:
        return live
    same = len(saved) == len(live) and all(
        sorted(index.get(p, -1) for p in s.get("params", [])) == sorted(g["params"])
        for s, g in zip(saved, live)
    )
    if not same:
        raise StateMismatchError(
            f"checkpoint entry {entry!r}: its {len(saved)} param groups do not hold the same "
            f"parameters as the optimizer's {len(live)}; build the optimizer's param groups as "
            "when it was saved",
            keys=[f"{entry}/param_groups"],
        )
    return [{**s, "params": g["params"]} for s, g in zip(saved, live)]
