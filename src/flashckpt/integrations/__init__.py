"""Drop-in integrations: Hugging Face Trainer, Lightning, DCP / safetensors / torch.save interop.

Each lives in its own module and imports its library only when used, so importing
``flashckpt.integrations`` needs neither ``transformers`` nor ``lightning``:

- :mod:`flashckpt.integrations.hf` — ``FlashCkptCallback`` and ``resume(trainer)``
- :mod:`flashckpt.integrations.lightning` — ``FlashCkptIO`` (a Lightning ``CheckpointIO``)
- :mod:`flashckpt.integrations.interop` — ``export``, ``export_dcp``, ``import_checkpoint``
- :mod:`flashckpt.integrations.dcp_layout` — DCP's own nested layout: ``import_dcp``,
  ``OptimizerByName`` (optimizer state keyed by parameter FQN)
- :mod:`flashckpt.integrations.hf_export` — ``export_hf`` (a ``from_pretrained`` directory)
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "FlashCkptCallback": "hf",
    "FlashCkptIO": "lightning",
    "OptimizerByName": "dcp_layout",
    "export_hf": "hf_export",
    "import_dcp": "dcp_layout",
    "latest_checkpoint": "lightning",
    "export": "interop",
    "export_dcp": "interop",
    "import_checkpoint": "interop",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'flashckpt.integrations' has no attribute {name!r}")
    return getattr(importlib.import_module(f"flashckpt.integrations.{module}"), name)
