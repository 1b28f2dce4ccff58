"""The kill trials' training state: a tiny model trained deterministically, so the state of
every step can be recomputed by the checker (``expected(step)``) and compared bitwise."""

from __future__ import annotations

from typing import Any

import torch

N_W = 65536  # 256 KiB of float32: 4 chunks of 64 KiB
_cache: list[dict[str, Any]] = []


def build() -> dict[str, Any]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    return {
        "model": model,
        "optim": opt,
        "w": torch.zeros(N_W),
        "frozen": torch.arange(N_W // 2, dtype=torch.float32),
        "meta": {"step": -1},
    }


def train_step(state: dict[str, Any], step: int) -> None:
    """One training step for ``step``: a function of the previous state and ``step`` only."""
    g = torch.Generator().manual_seed(step)
    x = torch.randn(16, 32, generator=g)
    model, opt = state["model"], state["optim"]
    loss = model(x).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    state["w"].copy_(torch.arange(N_W, dtype=torch.float32) + float(step // 3))
    state["meta"] = {"step": step}


def snapshot(state: dict[str, Any]) -> dict[str, Any]:
    opt = state["optim"].state_dict()
    return {
        "model": {k: v.clone() for k, v in state["model"].state_dict().items()},
        "momentum": [opt["state"][i]["momentum_buffer"].clone() for i in sorted(opt["state"])],
        "w": state["w"].clone(),
        "frozen": state["frozen"].clone(),
        "meta": dict(state["meta"]),
    }


def expected(step: int) -> dict[str, Any]:
    """The state saved as ``step`` (after training steps 0..step)."""
    if not _cache:
        _cache.append(build())
        _cache[0]["next"] = 0
        _cache.append({})
    live, snaps = _cache[0], _cache[1]
    while live["next"] <= step:
        train_step(live, live["next"])
        snaps[live["next"]] = snapshot(live)
        live["next"] += 1
    return snaps[step]


def same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return (
        a["meta"] == b["meta"]
        and torch.equal(a["w"], b["w"])
        and torch.equal(a["frozen"], b["frozen"])
        and a["model"].keys() == b["model"].keys()
        and all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
        and len(a["momentum"]) == len(b["momentum"])
        and all(torch.equal(x, y) for x, y in zip(a["momentum"], b["momentum"]))
    )
