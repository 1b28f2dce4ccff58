"""Deprecated alias of :mod:`flashckpt.distributed` (renamed: ``dist`` is the build-output folder
that ruff, pytest and packaging tools skip). ``flashckpt.dist.init_process_group`` keeps working
for one release and warns once; import it from ``flashckpt.distributed`` instead."""

from __future__ import annotations

import importlib
import warnings
from typing import Any

_warned = False


def __getattr__(name: str) -> Any:
    global _warned
    if name.startswith("__"):
        raise AttributeError(name)
    target = importlib.import_module("flashckpt.distributed")
    if not _warned:
        _warned = True
        warnings.warn(
            "flashckpt.dist is renamed flashckpt.distributed; import "
            f"{name} from flashckpt.distributed (the alias goes in the next release)",
            DeprecationWarning,
            stacklevel=2,
        )
    return getattr(target, name)
