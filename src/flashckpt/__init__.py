"""flashckpt: checkpoints that do not stop training, and GPU memory that fits.

The public face is small: :class:`Checkpointer`, :func:`restore` (read-only, no lock),
:class:`SaveHandle`, :class:`RNG`,
:class:`ResumableSampler`, the errors, and the ``flashckpt.policy`` and ``flashckpt.memory``
subpackages.
"""

from flashckpt import policy
from flashckpt.engine.checkpointer import Checkpointer
from flashckpt.engine.handle import SaveHandle, SaveStats
from flashckpt.engine.readonly import restore
from flashckpt.errors import (
    ConfigError,
    CorruptCheckpointError,
    DistributedError,
    FlashCkptError,
    LockedError,
    ManifestError,
    NoCheckpointError,
    SaveError,
    StateMismatchError,
    StorageError,
    UnsupportedStateError,
)
from flashckpt.state.rng import RNG
from flashckpt.state.sampler import ResumableSampler

__version__ = "0.1.0"

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
    "ResumableSampler",
    "SaveError",
    "SaveHandle",
    "SaveStats",
    "StateMismatchError",
    "StorageError",
    "UnsupportedStateError",
    "__version__",
    "policy",
    "restore",
]
