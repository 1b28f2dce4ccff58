"""Reserve the planned peak in PyTorch's CUDA caching allocator up front, and set its options.

Reserving early (one large allocation, freed back to the cache) means the run's tensors are
carved out of one segment instead of many, so it neither fragments nor hits ``cudaMalloc``
retries later; ``expandable_segments`` lets segments grow in place instead of stranding
partially used blocks (PyTorch docs, "CUDA memory management"). A per-process memory
fraction makes the allocator fail early and clearly instead of starving a co-located process.

How settings are applied (:func:`apply_allocator_settings`), so that each one takes effect:

* the user's own ``PYTORCH_CUDA_ALLOC_CONF`` always wins: a key they set is never overwritten
  (a differing value of ours is reported, not applied); ours are added beside theirs;
* before CUDA initialises, the variable is set *and* the settings are handed to the allocator
  directly (torch may have read the variable already, at import);
* after, only the direct call can apply them, to memory allocated from then on (segments
  reserved already keep theirs): a warning says so, and how to set them in time;
* ``garbage_collection_threshold`` acts only under a memory fraction (the allocator reclaims
  when usage passes the threshold *of the fraction*), so a threshold without a fraction sets a
  fraction of 1.0;
* the fraction is set on the device given, else on every device this process has a CUDA
  context on (never creating one on another GPU), else on the current device.

These are synchronous calls of the allocator's own API (no thread). On a machine without CUDA
every call explains what it would do and changes nothing.
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

    def conf_items(self) -> dict[str, str]:
        """The ``PYTORCH_CUDA_ALLOC_CONF`` keys and values (the fraction is set by a call)."""
        items = {"expandable_segments": str(self.expandable_segments)}
        if self.garbage_collection_threshold is not None:
            items["garbage_collection_threshold"] = str(self.garbage_collection_threshold)
        if self.max_split_size_bytes is not None:
            items["max_split_size_mb"] = str(self.max_split_size_bytes // MIB)
        return items

    def conf_string(self) -> str:
        """The ``PYTORCH_CUDA_ALLOC_CONF`` value (the memory fraction is set by a call instead)."""
        return _join(self.conf_items())

    @property
    def effective_fraction(self) -> float | None:
        """The fraction to set: the one given, or 1.0 when only a GC threshold is (it acts
        only under a fraction)."""
        if self.memory_fraction is None and self.garbage_collection_threshold is not None:
            return 1.0
        return self.memory_fraction


def _join(items: dict[str, str]) -> str:
    return ",".join(f"{k}:{v}" for k, v in items.items())


def _parse(conf: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for part in conf.split(","):
        key, _, value = part.partition(":")
        if key.strip():
            out[key.strip()] = value.strip()
    return out


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


def _fraction_devices(device: Any) -> list[Any]:
    """Where a fraction goes: ``device``; else every device with a CUDA context (asking
    creates none); else the current one."""
    if device is not None:
        return [device]
    has = getattr(torch._C, "_cuda_hasPrimaryContext", None)
    if has is not None and torch.cuda.is_initialized():
        found = [i for i in range(torch.cuda.device_count()) if has(i)]
        if found:
            return found
    return [torch.cuda.current_device()]


def _set_now(conf: str) -> None:
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    if setter is None:  # PyTorch before the accelerator API
        setter = torch.cuda.memory._set_allocator_settings
    setter(conf)


def apply_allocator_settings(
    settings: AllocatorSettings, *, device: Any = None, dry_run: bool = False
) -> list[str]:
    """Apply ``settings``; returns one line per action (what was done, or would be)."""
    user = _parse(os.environ.get(ALLOC_CONF_ENV, ""))
    ours = settings.conf_items()
    add = {k: v for k, v in ours.items() if k not in user}
    actions = [
        f"kept your {ALLOC_CONF_ENV} {k}:{user[k]} (not {v})"
        for k, v in ours.items()
        if k in user and user[k] != v
    ]
    conf = _join(add)
    live = _cuda_ready(device) and not dry_run
    if not conf:
        pass
    elif not live:
        actions.append(
            f"would set {ALLOC_CONF_ENV}={_join({**user, **add})} before CUDA initialises"
        )
    elif not torch.cuda.is_initialized():
        os.environ[ALLOC_CONF_ENV] = _join({**user, **add})  # the user's keys first, unchanged
        _set_now(conf)  # torch may have read the variable already (at import)
        actions.append(f"set {ALLOC_CONF_ENV}={os.environ[ALLOC_CONF_ENV]} (before CUDA init)")
    else:
        _set_now(conf)
        msg = (
            f"CUDA already initialised: {conf} applies only to memory allocated from now on "
            f"(segments reserved already keep their settings); set {ALLOC_CONF_ENV} before the "
            "first CUDA call to apply it to everything"
        )
        log.warning(msg)
        actions.append(msg)
    fraction = settings.effective_fraction
    if fraction is not None:
        why = (
            " (the GC threshold acts only under a fraction)"
            if settings.memory_fraction is None
            else ""
        )
        if live:
            for dev in _fraction_devices(device):
                torch.cuda.set_per_process_memory_fraction(fraction, dev)
                name = f"cuda:{dev}" if isinstance(dev, int) else str(dev)
                actions.append(f"set per-process memory fraction {fraction} on {name}{why}")
        else:
            actions.append(f"would set per-process memory fraction {fraction}{why}")
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
