from __future__ import annotations

import math
import os
from typing import Any

import pytest
import torch
from torch import nn

from flashckpt.errors import ConfigError
from flashckpt.memory import (
    AllocatorSettings,
    MemoryMonitor,
    MemorySample,
    MonitorPolicy,
    RecomputePlan,
    decide,
    estimate,
    preallocate,
    recommend_allocator_settings,
)

GIB = 1024**3


def _stats(allocated: int, reserved: int, peak: int, inactive: int = 0, retries: int = 0) -> dict:
    return {
        "allocated_bytes.all.current": allocated,
        "reserved_bytes.all.current": reserved,
        "allocated_bytes.all.peak": peak,
        "inactive_split_bytes.all.current": inactive,
        "num_alloc_retries": retries,
    }


def test_cpu_preallocate_explains_and_changes_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    # the user's own setting wins (issue 29): another test of this worker may have left one
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    env_before = dict(os.environ)
    est = estimate("gpt2", batch_size=8, seq_len=1024)
    report = preallocate(est, settings=AllocatorSettings(memory_fraction=0.5))
    assert not report.applied
    assert report.reserve_bytes == math.ceil(est.allocated_peak_bytes * 1.05)
    text = report.explain()
    assert "would set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" in text
    assert "would set per-process memory fraction 0.5" in text and "would reserve" in text
    assert dict(os.environ) == env_before
    with pytest.raises(ConfigError, match="margin"):
        preallocate(10, margin=2)
    with pytest.raises(ConfigError, match="MemoryEstimate"):
        preallocate("big")


def test_allocator_settings() -> None:
    s = AllocatorSettings(garbage_collection_threshold=0.9, max_split_size_bytes=512 * 1024**2)
    assert s.conf_string() == (
        "expandable_segments:True,garbage_collection_threshold:0.9,max_split_size_mb:512"
    )
    with pytest.raises(ConfigError, match="memory_fraction"):
        AllocatorSettings(memory_fraction=1.5)
    tight = recommend_allocator_settings(peak_bytes=70 * GIB, device_bytes=80 * GIB, shared=True)
    assert tight.garbage_collection_threshold == 0.9
    assert tight.memory_fraction == pytest.approx(70 / 80 * 1.1, abs=1e-3)
    loose = recommend_allocator_settings(peak_bytes=10 * GIB, device_bytes=80 * GIB)
    assert loose.garbage_collection_threshold is None and loose.memory_fraction is None


POLICY = MonitorPolicy(budget_bytes=20 * GIB)


def _samples(*stats: dict) -> list[MemorySample]:
    return [MemorySample.from_stats(f"p{i}", s) for i, s in enumerate(stats)]


def test_decide_on_recorded_stats() -> None:
    calm = _samples(_stats(5 * GIB, 12 * GIB, 10 * GIB))
    assert [a.kind for a in decide(calm, POLICY)] == ["ok"]
    near = _samples(_stats(5 * GIB, 19.5 * GIB, 19 * GIB))
    assert [a.kind for a in decide(near, POLICY)] == ["stricter_recompute"]
    retried = _samples(_stats(5 * GIB, 12 * GIB, 10 * GIB, retries=3))
    assert decide(retried, POLICY)[0].kind == "stricter_recompute"
    assert decide(retried, POLICY, previous_retries=3)[0].kind == "ok"  # no new retries
    under = decide(_samples(_stats(5 * GIB, 10 * GIB, 17.5 * GIB)), POLICY)
    assert under[0].kind == "grow_reservation"
    assert under[0].reserve_bytes == int(17.5 * GIB * 1.05)
    wasteful = decide(_samples(_stats(1 * GIB, 18 * GIB, 5 * GIB)), POLICY)
    assert wasteful[0].kind == "shrink_reservation"
    fragmented = decide(_samples(_stats(5 * GIB, 12 * GIB, 10 * GIB, inactive=3 * GIB)), POLICY)
    assert [a.kind for a in fragmented] == ["enable_expandable_segments"]
    assert decide([], POLICY)[0].kind == "ok"
    with pytest.raises(ConfigError, match="grow_at"):
        MonitorPolicy(budget_bytes=1, grow_at=0.99, stricter_at=0.9)


class FakeJournal:
    def __init__(self) -> None:
        self.events: list[tuple[str, dict[str, Any]]] = []

    def append(self, event: str, **fields: Any) -> None:
        self.events.append((event, fields))


def test_monitor_journals_samples_and_switches_to_a_stricter_plan() -> None:
    recorded = iter(
        [
            _stats(4 * GIB, 12 * GIB, 9 * GIB),
            _stats(6 * GIB, 12 * GIB, 10 * GIB),
            _stats(4 * GIB, 20 * GIB, 19.8 * GIB),  # step 2: near the budget
        ]
    )
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    plans = [
        RecomputePlan(recompute=(), activation_bytes=0, recompute_s=0.0),
        RecomputePlan(recompute=("0", "1"), activation_bytes=0, recompute_s=1.0),
    ]
    journal = FakeJournal()
    monitor = MemoryMonitor(
        policy=POLICY, journal=journal, model=model, plans=plans, stats_fn=lambda: next(recorded)
    )
    with monitor.phase("forward"):
        pass
    with monitor.phase("backward"):
        pass
    assert [a.kind for a in monitor.end_step()] == ["ok"]
    assert "forward" not in model[0].__dict__
    with monitor.phase("optimizer"):
        pass
    assert [a.kind for a in monitor.end_step()] == ["stricter_recompute"]
    assert "forward" in model[0].__dict__ and monitor.plan_index == 1
    assert [e for e, _ in journal.events] == ["memory"] * 3
    first = journal.events[0][1]
    assert first == {
        "phase": "forward",
        "allocated_bytes": 4 * GIB,
        "reserved_bytes": 12 * GIB,
        "max_allocated_bytes": 9 * GIB,
        "fragmentation_bytes": 8 * GIB,
        "alloc_retries": 0,
    }
    with pytest.raises(ConfigError, match="phase"), monitor.phase("lunch"):
        pass


def test_monitor_without_cuda_records_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    journal = FakeJournal()
    monitor = MemoryMonitor(policy=POLICY, journal=journal)
    assert not monitor.active and monitor.sample("forward") is None
    assert journal.events == [] and monitor.end_step()[0].kind == "ok"


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.gpu
@cuda
def test_gpu_preallocate_reserves_and_monitor_samples() -> None:
    report = preallocate(256 * 1024**2, margin=0.0)
    assert report.applied
    assert torch.cuda.memory_reserved() >= 256 * 1024**2
    monitor = MemoryMonitor(policy=MonitorPolicy(budget_bytes=torch.cuda.mem_get_info()[1]))
    with monitor.phase("forward"):
        x = torch.ones(1024, 1024, device="cuda")
    sample = monitor.samples[-1]
    assert sample.allocated_bytes >= x.numel() * 4
    assert sample.reserved_bytes >= sample.allocated_bytes
    monitor.end_step()
