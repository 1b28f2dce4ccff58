"""Allocator settings that take effect (issue 29, defect 8), on CPU with the CUDA calls
replaced by recorders: the user's own PYTORCH_CUDA_ALLOC_CONF is never overwritten, settings are
handed to the allocator directly (the variable alone can be read too early or too late), a
clear warning says when it is too late, a GC threshold gets the fraction it needs, the fraction
goes to every device with a context (and only those), and the monitor never grows the
reservation into an out-of-memory error."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch

from flashckpt.memory import (
    AllocatorSettings,
    MemoryMonitor,
    MonitorPolicy,
    apply_allocator_settings,
)
from flashckpt.memory.allocator.prealloc import ALLOC_CONF_ENV

MIB = 1 << 20


class FakeCuda:
    def __init__(
        self, monkeypatch: pytest.MonkeyPatch, *, initialized: bool, contexts=(0,)
    ) -> None:
        self.applied: list[str] = []
        self.fractions: list[tuple[float, Any]] = []
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "is_initialized", lambda: initialized)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        monkeypatch.setattr(
            torch._C, "_cuda_hasPrimaryContext", lambda i: i in contexts, raising=False
        )
        monkeypatch.setattr(
            torch._C, "_accelerator_setAllocatorSettings", self.applied.append, raising=False
        )
        monkeypatch.setattr(
            torch.cuda,
            "set_per_process_memory_fraction",
            lambda f, d=None: self.fractions.append((f, d)),
        )


def test_the_users_own_alloc_conf_is_never_overwritten(monkeypatch):
    monkeypatch.setenv(ALLOC_CONF_ENV, "expandable_segments:False,roundup_power2_divisions:4")
    cuda = FakeCuda(monkeypatch, initialized=False)
    actions = apply_allocator_settings(AllocatorSettings(max_split_size_bytes=256 * MIB))
    import os

    env = os.environ[ALLOC_CONF_ENV]
    assert env.startswith("expandable_segments:False,roundup_power2_divisions:4"), env
    assert "max_split_size_mb:256" in env
    assert cuda.applied == ["max_split_size_mb:256"], "only ours that the user did not set"
    assert any("kept your" in a and "expandable_segments:False" in a for a in actions)


def test_settings_reach_the_allocator_directly_before_init_and_warn_after(monkeypatch, caplog):
    monkeypatch.delenv(ALLOC_CONF_ENV, raising=False)
    before = FakeCuda(monkeypatch, initialized=False)
    apply_allocator_settings(AllocatorSettings())
    assert before.applied == ["expandable_segments:True"], "torch may have read the env already"
    after = FakeCuda(monkeypatch, initialized=True)
    monkeypatch.delenv(ALLOC_CONF_ENV, raising=False)
    with caplog.at_level(logging.WARNING):
        actions = apply_allocator_settings(AllocatorSettings())
    assert after.applied == ["expandable_segments:True"]
    assert any("CUDA already initialised" in r.message for r in caplog.records)
    assert any("allocated from now on" in a for a in actions)


def test_gc_threshold_gets_a_fraction_on_every_device_with_a_context(monkeypatch):
    monkeypatch.delenv(ALLOC_CONF_ENV, raising=False)
    cuda = FakeCuda(monkeypatch, initialized=True, contexts=(1, 3))
    apply_allocator_settings(AllocatorSettings(garbage_collection_threshold=0.8))
    assert cuda.fractions == [(1.0, 1), (1.0, 3)], "GC acts only under a fraction, per device"
    cuda.fractions.clear()
    apply_allocator_settings(AllocatorSettings(memory_fraction=0.5), device="cuda:2")
    assert cuda.fractions == [(0.5, "cuda:2")]


def test_monitor_grows_only_into_free_memory_and_never_raises(monkeypatch, caplog):
    free = {"bytes": 100 * MIB}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda d=None: 500 * MIB)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d=None: (free["bytes"], 1000 * MIB))
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda d=None: None)
    asked: list[int] = []
    real_empty = torch.empty

    def empty(*size, **kw):
        if kw.get("device") is not None and str(kw["device"]).startswith("cuda"):
            asked.append(int(size[0]))
            if size[0] > free["bytes"]:
                raise torch.cuda.OutOfMemoryError("CUDA out of memory (fake)")
            return real_empty(0)
        return real_empty(*size, **kw)

    monkeypatch.setattr(torch, "empty", empty)
    stats = {
        "allocated_bytes.all.current": 400 * MIB,
        "reserved_bytes.all.current": 500 * MIB,
        "allocated_bytes.all.peak": 880 * MIB,  # peak + margin wants 924 MiB reserved
    }
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda d=None: stats)
    monitor = MemoryMonitor(policy=MonitorPolicy(budget_bytes=1000 * MIB), device="cuda:0")
    monitor.sample("forward")
    kinds = [a.kind for a in monitor.end_step()]
    assert kinds == ["grow_reservation"]
    assert asked == [50 * MIB], "grew past the free memory (less the margin)"
    free["bytes"] = 10 * MIB  # under the margin: nothing to grow into
    monitor.sample("forward")
    with caplog.at_level(logging.WARNING):
        monitor.end_step()  # no OutOfMemoryError
    assert asked == [50 * MIB] and any("not growing" in r.message for r in caplog.records)
