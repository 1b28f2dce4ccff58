from __future__ import annotations

import itertools
import math
import random
from types import ModuleType

import pytest
import torch
from torch import nn

from conftest import GPT_TINY, LLAMA_TINY
from flashckpt.errors import ConfigError
from flashckpt.memory import (
    BlockProfile,
    EstimateOptions,
    MemoryPlanError,
    ModelProfile,
    evaluate_plan,
    every_k_plan,
    find_blocks,
    plan_recompute,
    profile,
    sqrt_plan,
)
from flashckpt.memory import activations as act


@pytest.mark.parametrize("shape", [GPT_TINY, LLAMA_TINY], ids=lambda s: s.name)
def test_activation_estimate_equals_saved_tensor_accounting(bench: ModuleType, shape) -> None:
    b, s = 2, 32
    model = bench.LM(shape)
    idx = torch.randint(0, shape.vocab, (b, s))
    prof = profile(model, idx, idx)
    opts = EstimateOptions(batch_size=b, seq_len=s, precision="fp32").activation_options()
    per_layer = act.layer_activation_bytes(shape, batch_size=b, seq_len=s, opts=opts)
    per_input = act.layer_input_bytes(shape, batch_size=b, seq_len=s, opts=opts)
    assert [blk.activation_bytes for blk in prof.blocks] == [per_layer] * shape.layers
    assert [blk.input_bytes for blk in prof.blocks] == [per_input] * shape.layers
    outer = act.outer_activation_bytes(shape, batch_size=b, seq_len=s, opts=opts)
    loss_saved = 4 * b * s * shape.vocab  # log-softmax output
    assert prof.other_activation_bytes == pytest.approx(outer + loss_saved, rel=0.01)
    assert all(blk.forward_s > 0 for blk in prof.blocks)


def test_profile_on_meta_counts_eager_attention(bench: ModuleType) -> None:
    # On meta, scaled_dot_product_attention takes the math path, which saves the s^2 scores:
    # exactly the estimate with flash_attention=False.
    idx = torch.randint(0, GPT_TINY.vocab, (2, 32), device="meta")
    with torch.device("meta"):
        model = bench.LM(GPT_TINY)
    meta = profile(model, idx, idx)
    opts = EstimateOptions(
        batch_size=2, seq_len=32, precision="fp32", flash_attention=False
    ).activation_options()
    per_layer = act.layer_activation_bytes(GPT_TINY, batch_size=2, seq_len=32, opts=opts)
    assert [b.activation_bytes for b in meta.blocks] == [per_layer] * GPT_TINY.layers
    assert meta.device == "meta" and meta.forward_s == 0.0


def test_find_blocks(bench: ModuleType) -> None:
    assert find_blocks(bench.LM(GPT_TINY)) == ["h.0", "h.1", "h.2"]
    with pytest.raises(ConfigError, match="blocks="):
        find_blocks(nn.Sequential(nn.Linear(2, 2)))
    with pytest.raises(ConfigError, match="not found"):
        profile(nn.Linear(2, 2), torch.ones(1, 2), blocks=["nope"])


def _brute_force(prof: ModelProfile, budget: int) -> float | None:
    best = None
    names = prof.block_names
    for r in range(len(names) + 1):
        for subset in itertools.combinations(names, r):
            plan = evaluate_plan(prof, subset)
            if plan.activation_bytes <= budget and (best is None or plan.recompute_s < best):
                best = plan.recompute_s
    return best


def _random_profile(rng: random.Random, n: int) -> ModelProfile:
    blocks = [
        BlockProfile(
            name=f"b{i}",
            activation_bytes=rng.randint(10, 100),
            input_bytes=rng.randint(1, 30),
            forward_s=rng.choice([0.5, 1.0, 1.5, 2.0, rng.random() * 3]),
        )
        for i in range(n)
    ]
    return ModelProfile(blocks=blocks, other_activation_bytes=rng.randint(0, 20))


def test_dp_is_optimal_against_brute_force() -> None:
    rng = random.Random(1234)
    checked = infeasible = 0
    for _ in range(150):
        prof = _random_profile(rng, rng.randint(1, 8))
        budget = rng.randint(20, prof.activation_bytes + 20)
        best = _brute_force(prof, budget)
        if best is None:
            infeasible += 1
            with pytest.raises(MemoryPlanError, match="even recomputing"):
                plan_recompute(prof, budget)
            continue
        plan = plan_recompute(prof, budget)
        assert plan.activation_bytes <= budget
        assert plan.activation_bytes == evaluate_plan(prof, plan.recompute).activation_bytes
        assert math.isclose(plan.recompute_s, best, rel_tol=1e-9, abs_tol=1e-12)
        checked += 1
    assert checked > 50 and infeasible > 5  # both paths exercised


def test_cost_model_by_hand() -> None:
    prof = ModelProfile(
        blocks=[
            BlockProfile(name="a", activation_bytes=100, input_bytes=10, forward_s=1.0),
            BlockProfile(name="b", activation_bytes=60, input_bytes=10, forward_s=0.2),
            BlockProfile(name="c", activation_bytes=80, input_bytes=10, forward_s=0.5),
        ],
        other_activation_bytes=5,
    )
    # recompute b and c: 100 (a kept) + 10 + 10 (inputs) + 80 (largest recomputed) + 5
    assert evaluate_plan(prof, ["b", "c"]).activation_bytes == 205
    assert plan_recompute(prof, 245).recompute == ()  # 100 + 60 + 80 + 5 fits as is
    # recomputing one block alone never helps here (input + live > what it saves):
    assert evaluate_plan(prof, ["b"]).activation_bytes == 255
    plan = plan_recompute(prof, 210)  # {b,c}: 205 at 0.7 s beats {a,b} 1.2 s and {a,c} 1.5 s
    assert plan.recompute == ("b", "c") and plan.recompute_s == pytest.approx(0.7)
    assert plan_recompute(prof, 150).recompute == ("a", "b", "c")  # 30 + 100 + 5 = 135
    with pytest.raises(MemoryPlanError, match="needs 135 B"):
        plan_recompute(prof, 130)


def test_baselines_and_dp_never_worse() -> None:
    blocks = [
        BlockProfile(name=f"l{i}", activation_bytes=100, input_bytes=5, forward_s=1.0 + i / 10)
        for i in range(9)
    ]
    prof = ModelProfile(blocks=blocks)
    assert every_k_plan(prof, k=3).recompute == ("l0", "l3", "l6")
    sqrt = sqrt_plan(prof)
    assert len(sqrt.recompute) == 6  # keeps sqrt(9) = 3 blocks
    for base in (every_k_plan(prof, k=2), sqrt):
        dp = plan_recompute(prof, base.activation_bytes)
        assert dp.recompute_s <= base.recompute_s + 1e-12
    with pytest.raises(ConfigError):
        every_k_plan(prof, k=0)


class _DropoutNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Dropout(0.3), nn.Linear(32, 16))
            for _ in range(4)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + layer(x)
        return x.pow(2).mean()


def _grads(model: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    torch.manual_seed(7)
    model.zero_grad(set_to_none=True)
    model(x).backward()
    return [p.grad.clone() for p in model.parameters()]


def test_apply_gives_bitwise_identical_grads_and_keeps_state_dict_keys() -> None:
    model = _DropoutNet()
    x = torch.randn(8, 16)
    keys = list(model.state_dict())
    reference = _grads(model, x)
    prof = profile(model, x)
    plan = plan_recompute(prof, prof.activation_bytes - 1)
    assert plan.recompute  # something must be recomputed
    full = evaluate_plan(prof, prof.block_names)
    full.apply(model)
    full.apply(model)  # idempotent
    assert all("forward" in model.layers[i].__dict__ for i in range(4))
    assert list(model.state_dict()) == keys
    for got, want in zip(_grads(model, x), reference):
        assert torch.equal(got, want)
    full.remove(model)
    assert all("forward" not in model.layers[i].__dict__ for i in range(4))
    with pytest.raises(ConfigError, match="lacks"):
        evaluate_plan(prof, ["layers.0"]).__class__(
            recompute=("nope",), activation_bytes=0, recompute_s=0.0
        ).apply(model)


def _brute_force_fewest(prof: ModelProfile, budget: int) -> tuple[float, int] | None:
    best = None
    for r in range(len(prof.block_names) + 1):
        for subset in itertools.combinations(prof.block_names, r):
            plan = evaluate_plan(prof, subset)
            key = (round(plan.recompute_s, 9), r)
            if plan.activation_bytes <= budget and (best is None or key < best):
                best = key
    return best


def test_planner_exact_on_uneven_sizes_and_zero_costs() -> None:
    """The branch-and-bound planner against brute force: uneven byte sizes (the case where the
    old Pareto DP took seconds at 100 blocks), and meta profiles whose costs are all zero
    (then the fewest blocks must win)."""
    rng = random.Random(99)
    for trial in range(80):
        n = rng.randint(1, 9)
        blocks = [
            BlockProfile(
                name=f"b{i}",
                activation_bytes=rng.randint(10**6, 10**9),
                input_bytes=rng.randint(1, 10**7),
                forward_s=0.0 if trial % 3 == 0 else rng.uniform(1e-4, 1e-2),
            )
            for i in range(n)
        ]
        prof = ModelProfile(blocks=blocks, other_activation_bytes=rng.randint(0, 10**7))
        budget = rng.randint(prof.activation_bytes // 4, prof.activation_bytes)
        want = _brute_force_fewest(prof, budget)
        if want is None:
            with pytest.raises(MemoryPlanError):
                plan_recompute(prof, budget)
            continue
        plan = plan_recompute(prof, budget)
        assert plan.activation_bytes <= budget
        assert (round(plan.recompute_s, 9), len(plan.recompute)) == want


def test_planner_on_many_identical_blocks_takes_the_fewest() -> None:
    """Identical blocks (every shape_profile) made the first branch and bound explore every
    symmetric subset; the count-aware bound cuts them. 48 blocks: brute force is out of reach,
    the optimum is known: ceil(need / saving per block) blocks."""
    blocks = [
        BlockProfile(name=f"l{i}", activation_bytes=1000, input_bytes=37, forward_s=0.01)
        for i in range(48)
    ]
    prof = ModelProfile(blocks=blocks, other_activation_bytes=11)
    for budget in (30_000, 24_011, 17_777):
        need = prof.activation_bytes + 1000 - budget  # the largest recomputed block stays live
        plan = plan_recompute(prof, budget)
        assert len(plan.recompute) == -(-need // (1000 - 37))
        assert plan.activation_bytes <= budget
