"""Moving modules to their device, deferred in a standby until it takes over.

``flashckpt.to_device(model, "cuda")`` is ``model.to("cuda")`` in an ordinary (or active)
process. In a standby (:mod:`.role`) it only records the module and its device and returns the
module where it is (host memory), so an idle standby holds no second copy of the model and
optimizer on the GPU; the takeover (:func:`materialise`, called by the Checkpointer after the
wait and before the restore loads anything) moves each recorded module, and the restore then
loads the memory tier's bytes straight into the device tensors.

An optimizer built over the module's parameters in the standby stays valid: the move swaps each
``Parameter``'s contents in place (``torch.utils.swap_tensors``; a plain ``Module.to`` would
replace a parameter whose tensor type changes, leaving the optimizer updating the old host
copy), and the restore loads the optimizer's state onto its parameters' device. (An optimizer
that needs device parameters when it is built, ``fused=True`` on CUDA, must be built after the
restore.)
"""

from __future__ import annotations

import threading
from typing import Any, TypeVar

from flashckpt.distributed.standby.role import is_standby

M = TypeVar("M")
_deferred: list[tuple[Any, Any]] = []
_lock = threading.Lock()


def to_device(module: M, device: Any) -> M:
    """``module.to(device)`` now, or at the takeover in a standby (see the module)."""
    if not is_standby():
        return module.to(device)  # type: ignore[attr-defined,no-any-return]
    with _lock:
        _deferred.append((module, device))
    return module


def deferred() -> list[tuple[Any, Any]]:
    """The (module, device) moves waiting for the takeover."""
    with _lock:
        return list(_deferred)


def materialise() -> int:
    """Move every deferred module to its device (at the takeover); returns how many moved."""
    with _lock:
        todo, _deferred[:] = list(_deferred), []
    for module, device in todo:
        _move_keeping_parameters(module, device)
    return len(todo)


def _move_keeping_parameters(module: Any, device: Any) -> None:
    """``module.to(device)`` that keeps every ``Parameter`` object (so optimizers built over them
    stay valid): ``Module.to`` replaces a parameter whose new tensor type cannot share the old
    one's (cpu -> meta, and other device types), unless swapping is on."""
    import torch

    swap = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        module.to(device)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(swap)
