"""Shared fixtures: small models and state builders used across the suite."""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch


@pytest.fixture
def tmp_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh directory named ``t<N>``, not after the test as pytest's own is: flashckpt's
    errors name the paths they are about, so ``pytest.raises(match="gap")`` in
    ``test_shards_with_a_gap...`` passed on the path alone, whatever the error said."""
    return tmp_path_factory.mktemp("t", numbered=True)


@pytest.fixture
def mem() -> Iterator[Path]:
    """A memory tier directory in /dev/shm (tmpfs), removed afterwards."""
    path = Path("/dev/shm") / f"fc-mem-{uuid.uuid4().hex[:10]}"
    yield path
    shutil.rmtree(path, ignore_errors=True)


class TinyNet(torch.nn.Module):
    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(width, width)
        self.bn = torch.nn.BatchNorm1d(width)
        self.drop = torch.nn.Dropout(0.1)
        self.fc2 = torch.nn.Linear(width, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.drop(torch.relu(self.bn(self.fc1(x)))))


def train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int, *, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    width = next(model.parameters()).shape[1]
    for _ in range(steps):
        x = torch.randn(16, width, generator=g)
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()


@pytest.fixture
def make_state() -> Callable[..., dict[str, Any]]:
    """``make_state(width=32, trained=2)``: model + AdamW + scheduler after some steps."""

    def build(*, width: int = 32, trained: int = 2, seed: int = 0) -> dict[str, Any]:
        torch.manual_seed(seed)
        model = TinyNet(width)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
        for _ in range(trained):
            train(model, opt, 1, seed=seed)
            sched.step()
        return {"model": model, "optim": opt, "sched": sched}

    return build


def assert_state_equal(a: dict[str, Any], b: dict[str, Any]) -> None:
    """Bitwise equality of two states' state_dicts (tensors compared exactly)."""

    def walk(x: Any, y: Any, path: str) -> None:
        if isinstance(x, torch.Tensor):
            assert isinstance(y, torch.Tensor), path
            assert x.dtype == y.dtype and x.shape == y.shape, path
            assert torch.equal(x, y), f"tensor differs at {path}"
        elif isinstance(x, dict):
            assert set(x) == set(y), f"{path}: keys {set(x) ^ set(y)}"
            for k in x:
                walk(x[k], y[k], f"{path}/{k}")
        elif isinstance(x, (list, tuple)):
            assert len(x) == len(y), path
            for i, (u, v) in enumerate(zip(x, y)):
                walk(u, v, f"{path}/{i}")
        else:
            assert x == y, f"{path}: {x!r} != {y!r}"

    for k in a:
        sa = a[k].state_dict() if hasattr(a[k], "state_dict") else a[k]
        sb = b[k].state_dict() if hasattr(b[k], "state_dict") else b[k]
        walk(sa, sb, k)


@pytest.fixture
def state_equal() -> Callable[[dict[str, Any], dict[str, Any]], None]:
    return assert_state_equal


def _without_sys_nice() -> None:
    """``preexec_fn``: the child may not raise a priority again, as an unprivileged user or a
    root without ``CAP_SYS_NICE`` (a container's): the capability leaves the bounding set (root
    keeps no more than it across ``exec``) and ``RLIMIT_NICE`` goes to 0."""
    import ctypes
    import resource

    if os.geteuid() == 0:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(24, 23, 0, 0, 0) != 0:  # PR_CAPBSET_DROP, CAP_SYS_NICE
            raise OSError(ctypes.get_errno(), "PR_CAPBSET_DROP")
    resource.setrlimit(resource.RLIMIT_NICE, (0, 0))


def _python_without_sys_nice(code: str) -> Any:
    """Run ``python -c code`` as a child that may not raise a priority again; its last line of
    output, parsed as JSON."""
    import json
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-c", code],
        preexec_fn=_without_sys_nice,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


@pytest.fixture
def python_without_sys_nice() -> Callable[[str], Any]:
    """``python -c CODE`` in a child that may not raise a priority again (see above): the
    JSON its last output line holds."""
    return _python_without_sys_nice
