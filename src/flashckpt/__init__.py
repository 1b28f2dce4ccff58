"""flashckpt: checkpoints that do not stop training, and GPU memory that fits.

The public face is small: :class:`Checkpointer`, :func:`restore` (read-only, no lock),
:class:`SaveHandle`, :class:`Promotion` (how the tiers below the fastest are fed), :class:`RNG`,
:class:`ResumableSampler`, :func:`to_device` (``module.to(device)``, deferred in a warm standby
until it takes over), the errors, and the ``flashckpt.policy`` and ``flashckpt.memory``
subpackages.

``import flashckpt`` loads only the errors: the engine (and with it xxhash, torch.distributed
helpers, the store) is imported on first use of a name below (PEP 562), so a training script
that imports flashckpt pays for it when it opens a Checkpointer, and a CLI or a worker that
only catches flashckpt's errors pays nothing. tests/test_import_lazy.py keeps it that way.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from flashckpt.errors import (
    ConfigError,
    CorruptCheckpointError,
    DistributedError,
    FlashCkptError,
    LockedError,
    ManifestError,
    NoCheckpointError,
    OutcomeUnknownError,
    SaveError,
    StateMismatchError,
    StorageError,
    UnsupportedFormatError,
    UnsupportedStateError,
)
from flashckpt.version import IMPORTED_T as _IMPORTED_T  # noqa: F401 (a restart milestone)
from flashckpt.version import __version__

if TYPE_CHECKING:
    from flashckpt import policy
    from flashckpt.distributed.standby.placement import to_device
    from flashckpt.engine.restore.readonly import restore
    from flashckpt.engine.runtime.checkpointer import Checkpointer
    from flashckpt.engine.save.handle import SaveHandle, SaveStats
    from flashckpt.engine.tiers.promote import Promotion
    from flashckpt.state.rng import RNG
    from flashckpt.state.sampler import ResumableSampler


# public name -> the module that defines it (imported on first access)
_LAZY = {
    "Checkpointer": "flashckpt.engine.runtime.checkpointer",
    "SaveHandle": "flashckpt.engine.save.handle",
    "SaveStats": "flashckpt.engine.save.handle",
    "Promotion": "flashckpt.engine.tiers.promote",
    "restore": "flashckpt.engine.restore.readonly",
    "RNG": "flashckpt.state.rng",
    "ResumableSampler": "flashckpt.state.sampler",
    "to_device": "flashckpt.distributed.standby.placement",
}


def __getattr__(name: str) -> Any:
    if name == "policy":
        return importlib.import_module("flashckpt.policy")
    where = _LAZY.get(name)
    if where is None:
        raise AttributeError(f"module 'flashckpt' has no attribute {name!r}")
    value = getattr(importlib.import_module(where), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


__all__ = [
    "RNG",
    "Checkpointer",
    "ConfigError",
    "CorruptCheckpointError",
    "DistributedError",
    "FlashCkptError",
    "LockedError",
    "ManifestError",
    "NoCheckpointError",
    "OutcomeUnknownError",
    "Promotion",
    "ResumableSampler",
    "SaveError",
    "SaveHandle",
    "SaveStats",
    "StateMismatchError",
    "StorageError",
    "UnsupportedFormatError",
    "UnsupportedStateError",
    "__version__",
    "policy",
    "restore",
    "to_device",
]
