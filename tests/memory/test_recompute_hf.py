"""RecomputePlan.apply on stock Hugging Face models, with their defaults (use_cache=True)."""

from __future__ import annotations

import pytest
import torch
from hf_tiny import model as tiny

from flashckpt.memory import RecomputePlan, find_blocks


def _batch() -> dict[str, torch.Tensor]:
    torch.manual_seed(1)
    ids = torch.randint(0, 97, (2, 12))
    mask = torch.ones_like(ids)
    mask[1, 8:] = 0  # a padded row
    labels = ids.masked_fill(mask == 0, -100)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels, "use_cache": True}


def _grads(model: torch.nn.Module) -> tuple[list[torch.Tensor], int]:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(7)  # the same dropout masks in both runs
    out = model(**_batch())
    out.loss.backward()
    cache = out.past_key_values if hasattr(out, "past_key_values") else out.cache
    length = cache.get_seq_length() if cache is not None else 0
    return [p.grad.clone() for p in model.parameters()], length


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_apply_on_hf_model_padded_batch_with_cache_gives_identical_grads(name: str) -> None:
    model = tiny(name).train()  # GPT-2 keeps HF's dropout 0.1: the RNG must be replayed
    reference, ref_len = _grads(model)
    plan = RecomputePlan(recompute=tuple(find_blocks(model)), activation_bytes=0, recompute_s=0)
    plan.apply(model)
    got, got_len = _grads(model)
    plan.remove(model)
    # HF's own gradient checkpointing turns the cache off for checkpointed layers; before the
    # fix each recomputed layer appended its K/V a second time (2 * ref_len)
    assert ref_len == 12 and got_len == 0
    assert len(got) == len(reference)
    for g, want in zip(got, reference, strict=True):
        assert torch.equal(g, want)


def test_apply_keeps_the_cache_without_grad() -> None:
    """Under no_grad there is no replay: a planned block still fills the cache (generation)."""
    model = tiny("llama").eval()
    plan = RecomputePlan(recompute=tuple(find_blocks(model)), activation_bytes=0, recompute_s=0)
    plan.apply(model)
    with torch.no_grad():
        out = model(input_ids=torch.randint(0, 97, (1, 5)), use_cache=True)
    cache = out.past_key_values if hasattr(out, "past_key_values") else out.cache
    assert cache.get_seq_length() == 5
