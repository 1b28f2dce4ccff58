"""A small catalog of common training GPUs: memory, bf16 throughput, a typical hourly price."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from functools import cache
from importlib import resources

from flashckpt.errors import ConfigError
from flashckpt.memory.units import MIB

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class GPU:
    """One GPU type; ``memory_bytes`` is the total nvidia-smi reports (CUDA context included)."""

    name: str
    label: str
    memory_bytes: int
    bf16_tflops: float
    usd_per_hour: float

    def __post_init__(self) -> None:
        if self.memory_bytes <= 0 or self.bf16_tflops <= 0:
            raise ConfigError(f"GPU {self.name!r}: memory_bytes and bf16_tflops must be > 0")


@cache
def _catalog() -> dict[str, GPU]:
    text = resources.files("flashckpt.memory").joinpath("gpus.json").read_text()
    out = {}
    for name, entry in json.loads(text).items():
        if name.startswith("_"):
            continue
        out[name] = GPU(
            name=name,
            label=entry["label"],
            memory_bytes=int(entry["memory_mib"]) * MIB,
            bf16_tflops=float(entry["bf16_tflops"]),
            usd_per_hour=float(entry["usd_per_hour"]),
        )
    return out


_ALIASES = {"4090": "rtx4090", "3090": "rtx3090", "5090": "rtx5090", "a100": "a100-80g"}
_ALIASES |= {"h100-sxm": "h100", "h100-80g": "h100", "a100-40gb": "a100-40g"}
_ALIASES |= {"a100-80gb": "a100-80g", "h200-141g": "h200"}


def known_gpus() -> list[str]:
    """Names accepted by :func:`gpu_by_name`."""
    return sorted(_catalog())


def gpu_by_name(name: str) -> GPU:
    """``rtx4090``, ``a100-40g``, ``a100-80g``, ``h100``, ``h200``, ... (case-insensitive)."""
    key = name.strip().lower().replace("_", "-").replace(" ", "")
    key = _ALIASES.get(key, key)
    if key not in _catalog():
        raise ConfigError(f"unknown GPU {name!r}; known: {', '.join(known_gpus())}")
    return _catalog()[key]
