"""torchtitan's checkpoint layout, both ways.

torchtitan's ``CheckpointManager`` saves one DCP state dict whose top level holds the model's
FQNs themselves (``tok_embeddings.weight``, ``layers.0.attention.wq.weight``, ...) beside four
entries: ``optimizer`` (the flat, FQN-keyed form: ``state.<fqn>.<name>`` tensors and
``param_groups.<fqn>.<key>`` values, one per parameter), ``lr_scheduler`` (``{"last_epoch":
n}``), ``train_state`` (``{"step": n, "ntokens_seen": m}``) and ``dataloader``
(``{"dp_rank_<r>": bytes, "world_size": n}``). DCP stores the non-tensor values as
``torch.save`` blobs.

**Export** (``flashckpt export ROOT OUT --format dcp --layout torchtitan``, and automatically
when the step's entries are named as torchtitan names them, :func:`is_torchtitan_entries`):
:func:`titan_state` builds exactly that state dict from a step's entries, whatever form the
optimizer was saved in (torchtitan's flat form, ``OptimizerByName``, or a plain id-keyed
``torch.optim`` state, named through the model entry as in ``dcp_layout``); the dataloader
entries of every rank are merged, as each torchtitan rank writes its own ``dp_rank_<r>``.
DCP reshards on load, so the full tensors written here load into FSDP2 shards on any number
of ranks.

**Import** (``flashckpt import SRC ROOT --format dcp``, when :func:`is_torchtitan_dcp`):
:func:`nest_titan` turns the flat names back into the five entries; the values (learning
rates, steps, the dataloader's bytes) are read with ``torch.load(weights_only=True)``. A
dataloader's bytes are kept in base64 (flashckpt's JSON tree holds no bytes; they are never
unpickled here); :class:`BytesState` wraps a dataloader so that it saves and restores in that
form.
"""

from __future__ import annotations

import base64
import logging
import os
from collections.abc import Mapping, Sequence
from typing import Any

from flashckpt.errors import ConfigError
from flashckpt.state.optim_names import flat_optimizer, is_flat_optimizer

log = logging.getLogger(__name__)

MODEL, OPTIMIZER, LR_SCHEDULER, TRAIN_STATE, DATALOADER = (
    "model",
    "optimizer",
    "lr_scheduler",
    "train_state",
    "dataloader",
)
ENTRIES = (MODEL, OPTIMIZER, LR_SCHEDULER, TRAIN_STATE, DATALOADER)
AUX = ENTRIES[1:]
LAYOUTS = ("dcp", "torchtitan")


# -- bytes in a JSON tree -------------------------------------------------------------------
BYTES_TAG = "__bytes_base64__"


def bytes_to_json(value: Any) -> Any:
    """``bytes`` (also inside dicts and lists) as ``{"__bytes_base64__": "..."}``: flashckpt's
    JSON tree holds no bytes, and a data position is small."""
    if isinstance(value, (bytes, bytearray)):
        return {BYTES_TAG: base64.b64encode(bytes(value)).decode("ascii")}
    if isinstance(value, Mapping):
        return {k: bytes_to_json(v) for k, v in value.items()}
    if isinstance(value, list):
        return [bytes_to_json(v) for v in value]
    return value


def json_to_bytes(value: Any) -> Any:
    """The inverse of :func:`bytes_to_json`."""
    if isinstance(value, Mapping):
        if set(value) == {BYTES_TAG} and isinstance(value[BYTES_TAG], str):
            return base64.b64decode(value[BYTES_TAG], validate=True)
        return {k: json_to_bytes(v) for k, v in value.items()}
    if isinstance(value, list):
        return [json_to_bytes(v) for v in value]
    return value


class BytesState:
    """A Stateful whose ``state_dict`` holds ``bytes`` (torchtitan's dataloader), saved by
    flashckpt with each ``bytes`` value in base64 (:func:`bytes_to_json`) and given back as
    ``bytes``. flashckpt never unpickles them; the dataloader does, as under torchtitan."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def state_dict(self) -> dict[str, Any]:
        return dict(bytes_to_json(self.inner.state_dict()))

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.inner.load_state_dict(json_to_bytes(dict(state)))


# -- export -----------------------------------------------------------------------------------
def is_torchtitan_entries(names: Sequence[str]) -> bool:
    """True when a step's entries are named as torchtitan names them: a ``model`` and an
    ``optimizer``, plus at least one of its other entries, and nothing else but ``rng``."""
    got = set(names) - {"rng"}
    return {MODEL, OPTIMIZER} <= got <= set(ENTRIES) and bool(got & {LR_SCHEDULER, TRAIN_STATE})


def entry_names(root: str | os.PathLike[str], step: int | None) -> list[str]:
    """The state entries of a step (newest when None), read from its manifest alone."""
    from flashckpt.integrations.saved import open_root, pick

    store = open_root(root)
    manifest = store.load_manifest(pick(store, root, step))
    return sorted({*manifest.tree, *manifest.rank_trees.get("0", {})})


def titan_state(entries: Mapping[str, Any], *, dataloaders: Sequence[Any] = ()) -> dict[str, Any]:
    """The state dict torchtitan's manager saves and loads, from a step's decoded entries."""
    from flashckpt.integrations.dcp_layout import dcp_state

    model = entries.get(MODEL)
    if not isinstance(model, Mapping) or not model:
        raise ConfigError("the torchtitan layout needs a model entry named 'model'")
    clash = sorted(set(model) & set(AUX))
    if clash:
        raise ConfigError(f"model FQN {clash[0]!r} collides with a torchtitan entry name")
    out: dict[str, Any] = dict(model)
    for name in AUX:
        value = entries.get(name)
        if value is None:
            continue
        if name == OPTIMIZER and not is_flat_optimizer(value):
            value = flat_optimizer(dcp_state({MODEL: model, OPTIMIZER: value})[OPTIMIZER])
        if name == DATALOADER:
            merged: dict[str, Any] = {}
            for d in [value, *dataloaders]:
                merged.update(d if isinstance(d, Mapping) else {})
            value = json_to_bytes(merged)
        out[name] = value
    return out


def export_torchtitan(
    root: str | os.PathLike[str], out: str | os.PathLike[str], *, step: int | None = None
) -> int:
    """Export one step of ``root`` as a DCP checkpoint in torchtitan's layout; its step."""
    from flashckpt.integrations.dcp_layout import save_dcp
    from flashckpt.integrations.saved import load_step, rank_entries

    saved = load_step(root, step=step)
    others = rank_entries(saved, DATALOADER)
    state = titan_state(saved.entries, dataloaders=others)
    save_dcp(state, out)
    log.info("exported step %d of %s in torchtitan's layout -> %s", saved.step, root, out)
    return saved.step


# -- import -----------------------------------------------------------------------------------
def is_torchtitan_dcp(flat: Mapping[str, Any]) -> bool:
    """True for torchtitan's layout: an ``optimizer.state.*`` entry and model FQNs at the top
    level (names whose first part is no torchtitan entry)."""
    heads = {k.partition(".")[0] for k in flat}
    has_optim = any(k.startswith(f"{OPTIMIZER}.state.") for k in flat)
    return has_optim and bool(heads - set(AUX))


def nest_titan(flat: Mapping[str, Any]) -> dict[str, Any]:
    """DCP's flat names of a torchtitan checkpoint as the five entries torchtitan uses."""
    out: dict[str, Any] = {MODEL: {}}
    for key, value in flat.items():
        head, _, rest = key.partition(".")
        if head in AUX and rest:
            out.setdefault(head, {})[rest] = value
        else:
            out[MODEL][key] = value
    if DATALOADER in out:
        out[DATALOADER] = bytes_to_json(out[DATALOADER])
    return out
