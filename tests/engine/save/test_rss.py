"""Host RSS stays flat across many async saves (no staging copy, capture or future leaks)."""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch

import flashckpt

MiB = 1 << 20
SAVES = 40


def _rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/self/status")


def _model(nbytes: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    width = 512
    layers = max(1, nbytes // ((width * width + width) * 4 * 3))
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    model(torch.randn(4, 512)).square().mean().backward()
    opt.step()  # with a save in flight, the optimizer hook waits for staging here
    opt.zero_grad(set_to_none=True)


def _growth(each: Callable[[int], None]) -> tuple[int, list[int]]:
    """Max RSS after warm-up minus the warm RSS, over ``SAVES`` calls of ``each``."""
    rss = []
    for i in range(SAVES):
        each(i)
        rss.append(_rss())
    warm = statistics.median(rss[3:8])
    return int(max(rss[8:]) - warm), rss


def test_rss_flat_over_40_async_saves(tmp_path):
    model, opt = _model(48 * MiB)
    _step(model, opt)  # optimizer state exists: ~48 MiB of params + moments
    state_bytes = sum(p.numel() * 4 * 3 for p in model.parameters())
    with flashckpt.Checkpointer(tmp_path, async_save=True, keep=2, fsync=False) as ck:

        def each(step: int) -> None:
            ck.save(step, {"model": model, "optim": opt})
            _step(model, opt)  # every chunk changes: every save stages and writes everything
            ck.wait()

        growth, rss = _growth(each)
    bound = max(24 * MiB, state_bytes // 2)  # one leaked staging copy per save is ~30x this
    assert growth < bound, f"RSS grew {growth / MiB:.1f} MiB after warm-up: {rss}"


def test_growth_measure_catches_a_leak():
    """The same measurement flags a leak of 4 MiB per call (so the test above can fail)."""
    kept = []

    def each(_i: int) -> None:
        kept.append(torch.ones(MiB))  # 4 MiB, touched

    growth, _ = _growth(each)
    assert growth > 24 * MiB
