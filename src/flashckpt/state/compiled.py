"""Key names that do not depend on how a model is wrapped.

``torch.compile`` wraps a module in an ``OptimizedModule`` whose ``state_dict()`` puts
``_orig_mod.`` in front of every key (``_orig_mod.lm_head.weight``, or ``block._orig_mod.w``
when one submodule is compiled). A checkpoint keyed that way would only restore into a model
compiled the same way. So, like ``torch.distributed.checkpoint.state_dict``, flashckpt removes
that segment from every string key of a state (and from the strings in lists, e.g. the FQNs in
an FQN-keyed optimizer's ``param_groups``) at capture, does the same to the target at restore,
and hands ``load_state_dict`` the target's own key names (:func:`rekey_like`). Checkpoints
written with ``_orig_mod.`` keys by older versions match through :func:`canonical_key`.

:func:`prefix_hint` explains a mismatch whose missing and unexpected keys differ only by a
prefix (a DDP ``module.``, a wrapper's attribute name).
"""

from __future__ import annotations

import re
from typing import Any

from flashckpt.errors import UnsupportedStateError

_COMPILED = re.compile(r"(?<![^./])_orig_mod\.")  # a whole dotted segment, not 'x_orig_mod.'
_MARK = "_orig_mod."


def canonical_key(key: str) -> str:
    """``key`` without any ``_orig_mod.`` segment (a state_dict key or a saved key path)."""
    return _COMPILED.sub("", key) if _MARK in key else key


def canonical(obj: Any, path: str = "") -> Any:
    """``obj`` with ``_orig_mod.`` removed from dict keys and list strings; the same object when
    there is nothing to remove (tensors and other leaves are never copied). One pass per
    container, and a tensor reference of a saved tree (``{"__t__": key}``) is not descended
    into: this runs over every state and tree a restore plans."""
    if isinstance(obj, dict):
        renamed: dict[Any, Any] = {}
        changed = False
        for k, v in obj.items():
            name = canonical_key(k) if isinstance(k, str) and _MARK in k else k
            if isinstance(v, (dict, list)) and not _is_ref(v):
                sub = canonical(v, f"{path}/{k}")
                changed = changed or sub is not v
                v = sub
            changed = changed or name is not k
            renamed[name] = v
        if len(renamed) != len(obj):
            clash = sorted(k for k in obj if isinstance(k, str) and _MARK in k)[:3]
            raise UnsupportedStateError(
                f"state at {path or '/'!r} has keys that are equal once torch.compile's "
                f"'_orig_mod.' is removed (e.g. {clash}); save the compiled and the plain "
                "module under different names"
            )
        return renamed if changed else obj
    if isinstance(obj, list):
        items = [canonical_key(v) if isinstance(v, str) else canonical(v, path) for v in obj]
        return obj if all(a is b for a, b in zip(obj, items)) else items
    return obj


def _is_ref(v: Any) -> bool:
    """A saved tree's tensor reference, ``{"__t__": key}`` or ``{"__np__": key}``: its one key
    is no state key, and canonical leaves it as it is."""
    if type(v) is not dict or len(v) != 1:
        return False
    ref = v.get("__t__", v.get("__np__"))
    return type(ref) is str


def rekey_like(decoded: Any, target: Any) -> Any:
    """``decoded`` (canonical keys) renamed to the keys ``target`` really uses, e.g. back to
    ``_orig_mod.w`` for a compiled module; anything ``target`` does not name is kept as is."""
    if isinstance(decoded, dict) and isinstance(target, dict):
        real = {canonical_key(k): k for k in target if isinstance(k, str) and _MARK in k}
        out: dict[Any, Any] = {}
        for k, v in decoded.items():
            name = real.get(k, k) if real and isinstance(k, str) else k
            out[name] = rekey_like(v, target.get(name)) if isinstance(v, (dict, list)) else v
        return out
    if isinstance(decoded, list) and isinstance(target, list) and len(decoded) == len(target):
        return [
            t
            if isinstance(d, str) and isinstance(t, str) and canonical_key(t) == d
            else rekey_like(d, t)
            for d, t in zip(decoded, target)
        ]
    return decoded


def prefix_hint(missing: list[str], unexpected: list[str]) -> str | None:
    """A sentence saying what to do when the missing keys (in the model, not the checkpoint)
    and the unexpected ones (the reverse) pair up by one prefix; keys are paths ``name/key``.
    None when they differ otherwise."""
    for extra, plain, side in ((unexpected, missing, "checkpoint"), (missing, unexpected, "model")):
        prefix = _common_prefix(sorted(extra), sorted(plain))
        if prefix is not None:
            name = plain[0].partition("/")[0]
            return (
                f"every mismatched key of {name!r} differs only by a prefix {prefix!r} that "
                f"the {side}'s keys have: {_advice(prefix)}"
            )
    return None


def _common_prefix(extra: list[str], plain: list[str]) -> str | None:
    """The one prefix that turns every key of ``plain`` into the key of ``extra`` (the part
    after the top-level ``name/``), or None."""
    if not plain or len(plain) != len(extra):
        return None
    name, _, first = plain[0].partition("/")
    top, _, other = extra[0].partition("/")
    if top != name or other == first or not other.endswith(first):
        return None
    prefix = other[: len(other) - len(first)]
    want = sorted(f"{name}/{prefix}{k.partition('/')[2]}" for k in plain)
    return prefix if want == extra else None


def _advice(prefix: str) -> str:
    if prefix == "module." or prefix.endswith(".module."):
        return (
            "a DDP/DataParallel wrapper's 'module.'; save and restore the same object, e.g. "
            "{'model': ddp_model.module} on both sides, or wrap the target the same way"
        )
    return "restore into the module that was saved (wrapped the same way), or strip the prefix"
