"""Reserve the planned peak in PyTorch's CUDA caching allocator up front, and set its options.

Reserving early (one large allocation, freed back to the cache) means the run's tensors are
carved out of one segment instead of many, so it neither fragments nor hits ``cudaMalloc``
retries later; ``expandable_segments`` lets segments grow in place instead of stranding
partially used blocks (PyTorch docs, "CUDA memory management"). Allocator options must be set
before CUDA initialises (``PYTORCH_CUDA_ALLOC_CONF``); a per-process memory fraction makes
the allocator fail early and clearly instead of starving a co-located process.

On a machine without CUDA every call explains what it would do and changes nothing.
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass, field
from typing import Any

import torch

from flashckpt.errors import ConfigError
from flashckpt.memory.units import MIB, format_bytes

log = logging.getLogger(__name__)

ALLOC_CONF_ENV = "PYTORCH_CUDA_ALLOC_CONF"


@dataclass(frozen=True, kw_only=True)
class AllocatorSettings:
    """Caching-allocator options (see ``PYTORCH_CUDA_ALLOC_CONF`` in the PyTorch docs)."""

    expandable_segments: bool = True
    memory_fraction: float | None = None
    garbage_collection_threshold: float | None = None
    max_split_size_bytes: int | None = None

    def __post_init__(self) -> None:
        for name in ("memory_fraction", "garbage_collection_threshold"):
            value = getattr(self, name)
            if value is not None and not 0 < value <= 1:
                raise ConfigError(f"AllocatorSettings.{name} must be in (0, 1], got {value}")
        if self.max_split_size_bytes is not None and self.max_split_size_bytes < 2 * MIB:
            raise ConfigError("AllocatorSettings.max_split_size_bytes must be >= 2 MiB")

    def conf_string(self) -> str:
        """The ``PYTORCH_CUDA_ALLOC_CONF`` value (the memory fraction is set by a call instead)."""
        parts = [f"expandable_segments:{self.expandable_segments}"]
        if self.garbage_collection_threshold is not None:
            parts.append(f"garbage_collection_threshold:{self.garbage_collection_threshold}")
        if self.max_split_size_bytes is not None:
            parts.append(f"max_split_size_mb:{self.max_split_size_bytes // MIB}")
        return ",".join(parts)


def recommend_allocator_settings(
    *, peak_bytes: int, device_bytes: int, shared: bool = False
) -> AllocatorSettings:
    """Settings for a run whose planned peak is ``peak_bytes`` on a ``device_bytes`` GPU.

    Expandable segments always (they remove most fragmentation at no cost on recent PyTorch);
    a garbage-collection threshold once the peak passes 80% of the device, so cached blocks are
    released before an allocation fails; and, when the GPU is ``shared``, a memory fraction
    of the planned peak plus 10%.
    """
    if device_bytes <= 0:
        raise ConfigError(f"device_bytes must be > 0, got {device_bytes}")
    ratio = peak_bytes / device_bytes
    fraction = min(1.0, round(ratio * 1.1, 3)) if shared else None
    return AllocatorSettings(
        expandable_segments=True,
        memory_fraction=fraction,
        garbage_collection_threshold=0.9 if ratio > 0.8 else None,
    )


@dataclass(kw_only=True)
class PreallocationReport:
    """What :func:`preallocate` did (``applied``) or would do on a CUDA machine."""

    reserve_bytes: int
    settings: AllocatorSettings
    applied: bool
    actions: list[str] = field(default_factory=list)

    def explain(self) -> str:
        head = "applied" if self.applied else "dry run (nothing changed)"
        return "\n".join([f"preallocate: {head}", *[f"  - {a}" for a in self.actions]])


def _cuda_ready(device: Any) -> bool:
    if not torch.cuda.is_available():
        return False
    return device is None or torch.device(device).type == "cuda"


def apply_allocator_settings(
    settings: AllocatorSettings, *, device: Any = None, dry_run: bool = False
) -> list[str]:
    """Apply ``settings``; returns one line per action (what was done, or would be)."""
    conf = settings.conf_string()
    live = _cuda_ready(device) and not dry_run
    actions: list[str] = []
    if not live:
        actions.append(f"would set {ALLOC_CONF_ENV}={conf} before CUDA initialises")
    elif not torch.cuda.is_initialized():
        os.environ[ALLOC_CONF_ENV] = conf
        actions.append(f"set {ALLOC_CONF_ENV}={conf} (CUDA not yet initialised)")
    else:
        setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
        if setter is None:  # PyTorch before the accelerator API
            setter = torch.cuda.memory._set_allocator_settings
        setter(conf)
        actions.append(f"CUDA already initialised: applied {conf} to new segments")
    if settings.memory_fraction is not None:
        if live:
            torch.cuda.set_per_process_memory_fraction(settings.memory_fraction, device)
            actions.append(f"set per-process memory fraction {settings.memory_fraction}")
        else:
            actions.append(f"would set per-process memory fraction {settings.memory_fraction}")
    return actions


def preallocate(
    peak_bytes: Any,
    *,
    margin: float = 0.05,
    device: Any = None,
    settings: AllocatorSettings | None = None,
    dry_run: bool = False,
) -> PreallocationReport:
    """Reserve ``peak_bytes`` (an int or a ``MemoryEstimate``) plus ``margin`` in the cache.

    Allocates one block of that size and frees it: the caching allocator keeps the segment, and
    the run's tensors are split out of it. Without CUDA (or with ``dry_run``) it only explains.
    """
    if not 0 <= margin < 1:
        raise ConfigError(f"margin must be in [0, 1), e.g. 0.05; got {margin}")
    allocated = getattr(peak_bytes, "allocated_peak_bytes", peak_bytes)
    if not isinstance(allocated, int) or allocated < 0:
        raise ConfigError(
            f"peak_bytes must be a byte count or a MemoryEstimate, got {peak_bytes!r}"
        )
    reserve = math.ceil(allocated * (1 + margin))
    settings = settings or AllocatorSettings()
    actions = apply_allocator_settings(settings, device=device, dry_run=dry_run)
    live = _cuda_ready(device) and not dry_run
    report = PreallocationReport(
        reserve_bytes=reserve, settings=settings, applied=live, actions=actions
    )
    if not live:
        reason = "no CUDA device" if not dry_run else "dry run"
        report.actions.append(
            f"would reserve {format_bytes(reserve)} (planned peak {format_bytes(allocated)} + "
            f"{margin:.0%}) in the caching allocator ({reason})"
        )
        log.info(report.explain())
        return report
    have = torch.cuda.memory_reserved(device)
    if reserve > have:
        block = torch.empty(reserve - have, dtype=torch.uint8, device=device or "cuda")
        del block  # the segment stays in PyTorch's cache, reserved for this process
    report.actions.append(
        f"reserved {format_bytes(torch.cuda.memory_reserved(device))} "
        f"(planned peak {format_bytes(allocated)} + {margin:.0%})"
    )
    log.info(report.explain())
    return report
