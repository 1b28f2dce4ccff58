"""Capture and restore the random number generators a training run depends on.

:class:`RNG` is a Stateful: put it in the state dict next to the model and optimizer and the
random streams after a restore are identical to the ones the interrupted run would have drawn
(Python ``random``, NumPy's global ``np.random``, the torch CPU generator and the CUDA
generators). Its ``state_dict()`` holds only tensors, NumPy arrays and JSON-able scalars, so it
is saved without pickle.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from flashckpt.errors import StateMismatchError, UnsupportedStateError

logger = logging.getLogger(__name__)

_MT_KEYS = 624  # MT19937 state words; Python's state adds the position as a 625th entry.


class RNG:
    """The global random generators as one Stateful.

    ``state_dict()`` returns::

        {"python": {"version": int, "state": [625 ints], "gauss": float | None},
         "numpy":  {"keys": np.ndarray[uint32, (624,)], "pos": int, "has_gauss": int,
                    "cached_gaussian": float},
         "torch":  torch.Tensor[uint8],          # torch.get_rng_state()
         "cuda":   [torch.Tensor[uint8], ...]}   # one per device

    Each part can be switched off with its keyword. CUDA states are captured only when CUDA is
    already initialised in this process (no random op can have used a CUDA generator before
    that, and capturing never initialises CUDA). On restore, CUDA states are set for the devices
    that exist; if the checkpoint has more states than this machine has GPUs (or none), a
    warning is logged and the rest are skipped. A part enabled here but missing from the
    checkpoint raises :class:`~flashckpt.errors.StateMismatchError`, except ``cuda``.

    ``load_state_dict`` accepts lists where ``state_dict`` produced tuples and tensors or lists
    where it produced NumPy arrays, as a checkpoint round trip may change them.
    """

    def __init__(
        self, *, python: bool = True, numpy: bool = True, torch: bool = True, cuda: bool = True
    ) -> None:
        self.python = python
        self.numpy = numpy
        self.torch = torch
        self.cuda = cuda

    def __repr__(self) -> str:
        parts = [p for p in ("python", "numpy", "torch", "cuda") if getattr(self, p)]
        return f"RNG({', '.join(parts)})"

    def state_dict(self) -> dict[str, Any]:
        """The current state of every enabled generator (see the class docstring)."""
        state: dict[str, Any] = {}
        if self.python:
            state["python"] = _python_state()
        if self.numpy:
            state["numpy"] = _numpy_state()
        if self.torch:
            state["torch"] = torch.get_rng_state()
        if self.cuda and torch.cuda.is_available() and torch.cuda.is_initialized():
            state["cuda"] = [
                torch.cuda.get_rng_state(device=i) for i in range(torch.cuda.device_count())
            ]
        return state

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore every enabled generator from ``state_dict``.

        Everything is validated before any generator is changed, so a bad state leaves the
        generators as they were.
        """
        if not isinstance(state_dict, Mapping):
            raise StateMismatchError(
                f"RNG state must be a dict, got {type(state_dict).__name__}", keys=["rng"]
            )
        wanted = [p for p in ("python", "numpy", "torch") if getattr(self, p)]
        missing = [p for p in wanted if p not in state_dict]
        if missing:
            raise StateMismatchError(
                f"RNG state has no {missing} (it has {sorted(state_dict)}); the checkpoint was "
                f"saved with these generators off: pass RNG({missing[0]}=False) to skip them",
                keys=missing,
            )
        py = _check_python(state_dict["python"]) if self.python else None
        npy = _check_numpy(state_dict["numpy"]) if self.numpy else None
        cpu = _check_byte_tensor(state_dict["torch"], "torch") if self.torch else None
        cuda = _check_cuda(state_dict.get("cuda")) if self.cuda else []
        if py is not None:
            random.setstate(py)
        if npy is not None:
            np.random.set_state(npy)
        if cpu is not None:
            torch.set_rng_state(cpu)
        _restore_cuda(cuda)


def _python_state() -> dict[str, Any]:
    version, internal, gauss = random.getstate()
    return {"version": int(version), "state": [int(x) for x in internal], "gauss": gauss}


def _numpy_state() -> dict[str, Any]:
    st = np.random.get_state(legacy=False)
    if not isinstance(st, dict) or st.get("bit_generator") != "MT19937":
        name = st.get("bit_generator") if isinstance(st, dict) else type(st).__name__
        raise UnsupportedStateError(
            f"np.random uses bit generator {name!r}; RNG captures only the legacy MT19937 "
            "global state: use RNG(numpy=False) and save your own numpy Generator instead"
        )
    return {
        "keys": np.array(st["state"]["key"], dtype=np.uint32, copy=True),
        "pos": int(st["state"]["pos"]),
        "has_gauss": int(st["has_gauss"]),
        "cached_gaussian": float(st["gauss"]),
    }


def _mismatch(part: str, why: str) -> StateMismatchError:
    return StateMismatchError(f"RNG state {part!r} is not valid: {why}", keys=[f"rng.{part}"])


def _is_int(x: Any) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def _check_python(value: Any) -> tuple[int, tuple[int, ...], float | None]:
    if not isinstance(value, Mapping) or not {"version", "state", "gauss"} <= set(value):
        raise _mismatch("python", "expected a dict with 'version', 'state', 'gauss'")
    internal = value["state"]
    if not isinstance(internal, (list, tuple)) or len(internal) != _MT_KEYS + 1:
        raise _mismatch("python", f"'state' must be a list of {_MT_KEYS + 1} ints")
    if not all(_is_int(x) for x in internal) or not _is_int(value["version"]):
        raise _mismatch("python", "'version' and every 'state' entry must be ints")
    gauss = value["gauss"]
    if gauss is not None and not isinstance(gauss, (int, float)):
        raise _mismatch("python", "'gauss' must be a float or None")
    return (
        int(value["version"]),
        tuple(int(x) for x in internal),
        None if gauss is None else float(gauss),
    )


def _check_numpy(value: Any) -> dict[str, Any]:
    fields = {"keys", "pos", "has_gauss", "cached_gaussian"}
    if not isinstance(value, Mapping) or not fields <= set(value):
        raise _mismatch("numpy", f"expected a dict with {sorted(fields)}")
    raw = value["keys"]
    keys = raw.numpy() if isinstance(raw, torch.Tensor) else np.asarray(raw)
    if keys.shape != (_MT_KEYS,) or keys.dtype.kind not in "ui":
        raise _mismatch("numpy", f"'keys' must be {_MT_KEYS} unsigned 32-bit ints")
    if not (_is_int(value["pos"]) and _is_int(value["has_gauss"])):
        raise _mismatch("numpy", "'pos' and 'has_gauss' must be ints")
    if not isinstance(value["cached_gaussian"], (int, float)):
        raise _mismatch("numpy", "'cached_gaussian' must be a float")
    return {
        "bit_generator": "MT19937",
        "state": {"key": keys.astype(np.uint32), "pos": int(value["pos"])},
        "has_gauss": int(value["has_gauss"]),
        "gauss": float(value["cached_gaussian"]),
    }


def _check_byte_tensor(value: Any, part: str) -> torch.Tensor:
    if isinstance(value, np.ndarray):
        value = torch.from_numpy(value)
    if not isinstance(value, torch.Tensor) or value.dtype != torch.uint8 or value.dim() != 1:
        raise _mismatch(part, "expected a 1-D uint8 tensor (a torch generator state)")
    return value.detach().to("cpu").contiguous()


def _check_cuda(value: Any) -> list[torch.Tensor]:
    if value is None:
        return []
    if not isinstance(value, (list, tuple)):
        raise _mismatch("cuda", "expected a list of uint8 tensors, one per device")
    return [_check_byte_tensor(v, "cuda") for v in value]


def _restore_cuda(states: list[torch.Tensor]) -> None:
    if not states:
        return
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count < len(states):
        logger.warning(
            "the checkpoint has CUDA RNG states for %d devices but this machine has %d; "
            "restoring %d and skipping the rest (random streams on the missing devices "
            "cannot continue)",
            len(states),
            count,
            min(count, len(states)),
        )
    for i, st in enumerate(states[:count]):
        torch.cuda.set_rng_state(st, device=i)


__all__ = ["RNG"]
