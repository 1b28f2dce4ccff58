from __future__ import annotations

import pytest
import torch

from flashckpt.errors import ConfigError
from flashckpt.memory import MemoryPlanError, estimate, max_batch_size, model_max_batch_size


def test_model_answer_is_the_largest_that_fits() -> None:
    budget = 24 * 1024**3
    b = model_max_batch_size("gpt2", budget_bytes=budget, seq_len=1024)
    assert estimate("gpt2", batch_size=b, seq_len=1024).peak_bytes <= budget
    assert estimate("gpt2", batch_size=b + 1, seq_len=1024).peak_bytes > budget
    with pytest.raises(MemoryPlanError, match="batch size 1"):
        model_max_batch_size("llama-2-70b", budget_bytes=budget, seq_len=4096)


class FakeDevice:
    """Peak = 1000 + 100*b bytes; raises an OOM above ``capacity``."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.calls: list[int] = []

    def __call__(self, b: int) -> int:
        self.calls.append(b)
        peak = 1000 + 100 * b
        if peak > self.capacity:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate ...")
        return peak


@pytest.mark.parametrize("capacity", [1100, 1750, 5000, 200_000])
def test_trial_search_finds_the_exact_largest_and_never_tries_zero(capacity: int) -> None:
    device = FakeDevice(capacity)
    result = max_batch_size(budget_bytes=capacity, trial=device, safety_margin=0.0)
    assert result.batch_size == (capacity - 1000) // 100
    assert min(device.calls) >= 1
    assert len(device.calls) < 40  # binary search, not a linear scan


def test_trial_confirms_and_corrects_a_too_optimistic_model() -> None:
    budget = 24 * 1024**3
    guess = model_max_batch_size("gpt2", budget_bytes=budget, seq_len=1024)
    device = FakeDevice(capacity=1000 + 100 * (guess // 2))  # the real device holds half

    def trial(b: int) -> int:
        device(b)
        return 1

    result = max_batch_size("gpt2", budget_bytes=budget, seq_len=1024, trial=trial)
    assert result.model_batch_size == guess
    assert result.batch_size == guess // 2
    assert device.calls[0] == guess


def test_largest_batch_from_the_model_is_exact_at_the_boundary() -> None:
    """Issue 32: the largest batch came out one below the truth: max_batch_size shrank the
    budget by safety_margin on top of the estimate's own fragmentation margin. A budget of
    exactly batch 6's estimated peak gives 6, through either entry point."""
    need = estimate("gpt2", batch_size=6, seq_len=1024).peak_bytes
    assert model_max_batch_size("gpt2", budget_bytes=need, seq_len=1024) == 6
    assert max_batch_size("gpt2", budget_bytes=need, seq_len=1024).batch_size == 6
    assert model_max_batch_size("gpt2", budget_bytes=need - 1, seq_len=1024) == 5


def test_safety_margin_is_applied() -> None:
    result = max_batch_size(budget_bytes=2100, trial=FakeDevice(10**9), safety_margin=0.05)
    assert result.batch_size == 10  # 2000 * 1.05 = 2100 fits; 2100 * 1.05 does not


def test_batch_one_not_fitting_is_a_clear_error_not_zero() -> None:
    with pytest.raises(MemoryPlanError, match="batch size 1 does not fit"):
        max_batch_size(budget_bytes=1050, trial=FakeDevice(1050))


def test_other_errors_propagate_and_bad_arguments() -> None:
    def broken(_b: int) -> int:
        raise ValueError("shape mismatch")

    with pytest.raises(ValueError, match="shape mismatch"):
        max_batch_size(budget_bytes="1GiB", trial=broken)
    with pytest.raises(ConfigError, match="needs a model"):
        max_batch_size(budget_bytes=100)
    with pytest.raises(ConfigError, match="budget_bytes"):
        max_batch_size("gpt2", budget_bytes="lots", seq_len=8)


def test_model_max_batch_of_a_hf_model_is_confirmed_by_traces() -> None:
    """A traced model's largest batch: sized on a line between traces, then confirmed by
    tracing the answer and the next batch (the peak is convex in the batch: a line through
    batch 1 and 2 is low at batch 5 for this model, whose backward peak moves)."""
    from hf_tiny import model as tiny

    model = tiny("llama")

    def peak(b: int) -> int:
        return estimate(model, device="cpu", batch_size=b, seq_len=16).peak_bytes

    budget = peak(6) + (peak(7) - peak(6)) // 2
    b = model_max_batch_size(model, budget_bytes=budget, device="cpu", seq_len=16)
    assert b == 6
