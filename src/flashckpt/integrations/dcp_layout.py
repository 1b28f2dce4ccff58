"""DCP in DCP's own conventions: export a step as ``dcp.save`` would have written it, and back.

**Export** (``flashckpt export ROOT OUT --format dcp``, :func:`export_dcp`) writes the state
entries as one nested dict — ``{"model": {fqn: tensor}, "optim": {"state": {fqn: {...}},
"param_groups": [...]}, ...}`` — through ``torch.distributed.checkpoint.save``, so DCP flattens
it with its own rules (``model.<fqn>``, ``optim.state.<fqn>.exp_avg``, non-tensor values as DCP's
pickled bytes entries). A DCP or torchtitan user then loads it with the state they already
build::

    sd = {"model": model.state_dict(), "optim": get_optimizer_state_dict(model, opt)}
    dcp.load(sd, checkpoint_id=OUT)            # any number of ranks
    set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])

The entry names are the flashckpt state's own names (save ``"optimizer"`` to match torchtitan).
Entries holding NumPy arrays (``flashckpt.RNG``) are left out. ``prefix="model"`` keeps the
model-only form (keys without a prefix, for ``dcp.load(model.state_dict(), ...)``).

**Optimizer parameter names.** ``torch.optim`` saves state keyed by integer ids (the position
of each parameter across ``param_groups``); DCP keys it by parameter FQN, as
``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict`` does. The ids are mapped
to names by, in order of preference:

1. nothing to map: the optimizer was saved as :class:`OptimizerByName` ``(model, opt)``, whose
   state is FQN-keyed already (exact, and the recommended way to save for DCP users);
2. ``param_fqns=`` — the names in id order, e.g. :func:`param_fqns` ``(model, opt)`` (exact);
3. otherwise the saved model entry's floating-point tensors in their saved (``state_dict``)
   order, which names id *k* correctly when the optimizer was built from
   ``model.parameters()`` in one order. Buffers and tied weights in between are skipped only
   when every parameter's saved optimizer state gives its shape; anything else (param groups
   in another order, as nanoGPT builds them, parameters without state) raises ConfigError
   rather than guess.

**Import** (:func:`import_dcp`, and ``flashckpt import`` when :func:`is_nested`) reads a DCP
checkpoint in that layout (``dcp_metadata.load_dcp`` reads the tensors) and saves a flashckpt step
with one entry per top-level DCP name: the model entry ``{fqn: tensor}`` restores into the
model; the optimizer entry is FQN-keyed and restores into the plain optimizer, named through
the model restored with it (state/optim_names.py), or through :class:`OptimizerByName`::

    ckpt.restore({"model": model, "optim": opt})   # or "optim": OptimizerByName(model, opt)

DCP stores ``param_groups`` (learning rates, betas) as pickled bytes; flashckpt never unpickles
them, so after an import the hyperparameters are those of the live optimizer (and scheduler).
"""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from flashckpt.errors import ConfigError

log = logging.getLogger(__name__)

_SINGLE_PROCESS = ".*assuming the intent is to (save|load) in a single process"


# -- the optimizer in FQN form ------------------------------------------------------------
class OptimizerByName:
    """An optimizer whose state is saved keyed by parameter FQN (DCP's form), not by id.

    ``state_dict`` is ``get_optimizer_state_dict(model, optimizer)``; ``load_state_dict`` is
    ``set_optimizer_state_dict``, keeping the live ``param_groups`` when the saved ones are
    missing (a DCP import carries none).
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model = model
        self.optimizer = optimizer

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        return dict(get_optimizer_state_dict(self.model, self.optimizer))

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        sd = dict(state)
        if not sd.get("param_groups"):
            sd["param_groups"] = self.state_dict()["param_groups"]
        set_optimizer_state_dict(self.model, self.optimizer, sd)  # type: ignore[arg-type]


def param_fqns(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """The FQN of each of ``optimizer``'s parameters, in the id order its state_dict uses."""
    names: dict[int, str] = {}
    for name, p in model.named_parameters():
        names.setdefault(id(p), name)
    out = []
    for g, group in enumerate(optimizer.param_groups):
        for p in group["params"]:
            if id(p) not in names:
                raise ConfigError(f"param group {g} holds a parameter that is not in the model")
            out.append(names[id(p)])
    return out


def is_optimizer_state(value: Any) -> bool:
    """True for a ``torch.optim`` state_dict (``{"state": {...}, "param_groups": [...]}``)."""
    return (
        isinstance(value, Mapping)
        and isinstance(value.get("state"), Mapping)
        and isinstance(value.get("param_groups"), list)
        and all(isinstance(g, Mapping) and "params" in g for g in value["param_groups"])
    )


def _ids(optim: Mapping[str, Any]) -> list[Any]:
    return [pid for g in optim["param_groups"] for pid in g["params"]]


def _state_shape(per_param: Any) -> tuple[int, ...] | None:
    """The parameter's shape as its optimizer state tells it (``exp_avg``, momentum), or None."""
    if not isinstance(per_param, Mapping):
        return None
    for key, v in per_param.items():
        if key != "step" and isinstance(v, torch.Tensor):
            return tuple(v.shape)
    return None


def infer_param_fqns(model_sd: Mapping[str, Any], optim: Mapping[str, Any]) -> list[str]:
    """Names for the optimizer's ids from the model's saved order (rule 3 of the module doc)."""
    ids = _ids(optim)
    what = (
        "pass param_fqns=param_fqns(model, opt), save the optimizer as "
        "OptimizerByName(model, opt), or export the model alone (--prefix model)"
    )
    if ids != list(range(len(ids))):
        raise ConfigError(f"optimizer param ids are not 0..{len(ids) - 1}; {what}")
    cands = [
        k for k, t in model_sd.items() if isinstance(t, torch.Tensor) and t.is_floating_point()
    ]
    shapes = [_state_shape(optim["state"].get(pid)) for pid in ids]
    if len(cands) == len(ids) and all(
        s is None or s == tuple(model_sd[c].shape) for s, c in zip(shapes, cands)
    ):
        return cands
    if any(s is None for s in shapes):
        raise ConfigError(
            f"cannot name the optimizer's {len(ids)} parameters from the model's "
            f"{len(cands)} floating-point tensors (some parameters have no optimizer state to "
            f"tell their shape); {what}"
        )
    out, j = [], 0
    for pid, shape in zip(ids, shapes):
        while j < len(cands) and tuple(model_sd[cands[j]].shape) != shape:
            j += 1
        if j == len(cands):
            raise ConfigError(
                f"optimizer parameter {pid} (shape {list(shape or ())}) matches no model tensor "
                f"in saved order (param groups in another order than model.parameters()?); "
                f"{what}"
            )
        out.append(cands[j])
        j += 1
    log.info("export: optimizer ids named by shape; skipped %s", sorted(set(cands) - set(out)))
    return out


def optimizer_by_name(optim: Mapping[str, Any], fqns: Sequence[str]) -> dict[str, Any]:
    """``optim`` (id-keyed) as DCP's FQN-keyed form, given the names in id order."""
    ids = _ids(optim)
    if len(fqns) != len(ids):
        raise ConfigError(f"param_fqns names {len(fqns)} parameters; the optimizer has {len(ids)}")
    name = dict(zip(ids, fqns))
    state = {name[pid]: dict(v) for pid, v in optim["state"].items() if pid in name}
    groups = [{**g, "params": [name[pid] for pid in g["params"]]} for g in optim["param_groups"]]
    return {"state": state, "param_groups": groups}


def dcp_state(
    entries: Mapping[str, Any],
    *,
    param_fqns: Sequence[str] | None = None,
    model_entry: str = "model",
) -> dict[str, Any]:
    """The nested state DCP users build, from a saved step's decoded ``entries``."""
    out = dict(entries)
    for name, value in entries.items():
        if not is_optimizer_state(value) or all(isinstance(p, str) for p in _ids(value)):
            continue  # not an optimizer, or FQN-keyed already (OptimizerByName)
        fqns = param_fqns
        if fqns is None:
            model_sd = entries.get(model_entry)
            if not isinstance(model_sd, Mapping):
                raise ConfigError(
                    f"entry {name!r} is an optimizer keyed by parameter id and there is no "
                    f"model entry {model_entry!r} to name its parameters; pass model_entry= or "
                    "param_fqns="
                )
            fqns = infer_param_fqns(model_sd, value)
        out[name] = optimizer_by_name(value, fqns)
    return out


# -- writing and reading ------------------------------------------------------------------
def _contiguous(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.contiguous()
    if isinstance(value, Mapping):
        return {k: _contiguous(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_contiguous(v) for v in value]
    return value


def save_dcp(state: Mapping[str, Any], out: str | os.PathLike[str]) -> None:
    """``dcp.save`` of ``state`` in one process into the new (or empty) directory ``out``."""
    import torch.distributed.checkpoint as dcp

    out_path = Path(out)
    if out_path.exists() and any(out_path.iterdir()):
        raise ConfigError(f"{out} exists and is not empty; DCP output needs a new directory")
    out_path.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_SINGLE_PROCESS)
        dcp.save(
            _contiguous(dict(state)),
            storage_writer=dcp.FileSystemWriter(str(out_path)),
            no_dist=True,
        )


def export_dcp(
    root: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    step: int | None = None,
    param_fqns: Sequence[str] | None = None,
    model_entry: str = "model",
) -> int:
    """Export one step (newest by default) of ``root`` as a nested DCP checkpoint; its step."""
    from flashckpt.integrations.saved import load_step

    saved = load_step(root, step=step)
    state = dcp_state(saved.entries, param_fqns=param_fqns, model_entry=model_entry)
    if not state:
        raise ConfigError(f"step {saved.step} of {root} has no entry DCP can hold")
    save_dcp(state, out)
    log.info("exported step %d of %s as DCP (%s) -> %s", saved.step, root, sorted(state), out)
    return saved.step


def nest_dcp(flat: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    """DCP's flattened names back to state entries (the inverse of the export layout).

    ``<entry>.<rest>`` splits at the first dot. An entry whose keys are all
    ``state.<fqn>.<name>`` (and ``param_groups.*``) is an FQN-keyed optimizer.
    """
    groups: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in flat.items():
        head, dot, rest = key.partition(".")
        if not dot or not rest:
            raise ConfigError(f"DCP key {key!r} has no '<entry>.' prefix; not a nested layout")
        groups.setdefault(head, {})[rest] = t
    out: dict[str, Any] = {}
    for name, sub in groups.items():
        if all(k.startswith("state.") for k in sub) and all(k.count(".") >= 2 for k in sub):
            state: dict[str, dict[str, torch.Tensor]] = {}
            for k, t in sub.items():
                fqn, _, leaf = k[len("state.") :].rpartition(".")
                state.setdefault(fqn, {})[leaf] = t
            out[name] = {"state": state, "param_groups": []}
        else:
            out[name] = sub
    return out


def is_nested(flat: Mapping[str, Any]) -> bool:
    """True when ``flat`` (DCP's flattened names) holds an entry whose keys are all
    ``state.<fqn>.<name>``: the FQN-keyed optimizer of ``{"model": ..., "optim": ...}``. A
    model-only checkpoint (``dcp.save(model.state_dict())``) has no such entry."""
    heads: dict[str, list[str]] = {}
    for key in flat:
        head, dot, rest = key.partition(".")
        if not dot or not rest:
            return False
        heads.setdefault(head, []).append(rest)
    return any(
        all(k.startswith("state.") and k.count(".") >= 2 for k in keys) for keys in heads.values()
    )


def import_dcp(
    src: str | os.PathLike[str],
    root: str | os.PathLike[str],
    *,
    step: int = 0,
    compression: str | None = None,
) -> dict[str, Any]:
    """Save the nested DCP checkpoint ``src`` as flashckpt step ``step`` of ``root``."""
    from flashckpt.engine.runtime.checkpointer import Checkpointer
    from flashckpt.integrations.dcp_metadata import load_dcp

    state = nest_dcp(load_dcp(src))
    with Checkpointer(root, compression=compression) as ckpt:
        if step in ckpt.steps():
            raise ConfigError(f"step {step} already exists in {root}; choose another step")
        ckpt.save(step, state)
    log.info("imported DCP %s into %s as step %d (%s)", src, root, step, sorted(state))
    return state
