"""Content-addressed chunks: unchanged bytes are never written twice; small tensors are packed."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import flashckpt


def _chunk_count(root: Path) -> int:
    return sum(1 for p in (root / "chunks").rglob("*") if p.is_file())


@pytest.mark.parametrize("async_save", [False, True])
def test_unchanged_state_writes_nothing_new(tmp_path, make_state, async_save):
    state = make_state(width=128)
    with flashckpt.Checkpointer(tmp_path, async_save=async_save, chunk_size="16KiB") as ckpt:
        first = ckpt.save(1, state).wait()
        second = ckpt.save(2, state).wait()
    assert first.new_bytes == first.total_bytes > 0
    assert second.new_bytes == 0 and second.reused_bytes == second.total_bytes


def test_incremental_off_rewrites(tmp_path, make_state):
    state = make_state(width=64)
    with flashckpt.Checkpointer(tmp_path, incremental=False) as ckpt:
        ckpt.save(1, state)
        again = ckpt.save(2, state).wait()
    assert again.new_bytes == again.total_bytes


class LoraNet(torch.nn.Module):
    """A frozen base (99%+ of bytes) plus small trainable low-rank adapters."""

    def __init__(self, width: int = 1024, layers: int = 4, rank: int = 1) -> None:
        super().__init__()
        self.base = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(layers))
        for p in self.base.parameters():
            p.requires_grad_(False)
        self.a = torch.nn.ParameterList(
            torch.nn.Parameter(torch.randn(rank, width) * 0.01) for _ in range(layers)
        )
        self.b = torch.nn.ParameterList(
            torch.nn.Parameter(torch.zeros(width, rank)) for _ in range(layers)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for lin, a, b in zip(self.base, self.a, self.b):
            x = torch.tanh(lin(x) + x @ a.t() @ b.t())
        return x


def test_lora_second_save_writes_at_most_two_percent(tmp_path):
    torch.manual_seed(0)
    model = LoraNet()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)

    def step() -> None:
        loss = model(torch.randn(8, 1024)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()

    step()
    state = {"model": model, "optim": opt}
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad) * 4 * 3
    total = sum(p.numel() for p in model.parameters()) * 4 + trainable * 2 // 3  # + moments
    assert trainable / total < 0.01, "test setup: the frozen part must be 99% of the bytes"
    with flashckpt.Checkpointer(tmp_path) as ckpt:
        first = ckpt.save(1, state).wait()
        step()
        second = ckpt.save(2, state).wait()
    assert second.new_bytes > 0, "the adapters changed, so something must be written"
    assert second.new_bytes <= 0.02 * first.new_bytes, (second.new_bytes, first.new_bytes)
    target = {"model": LoraNet(), "optim": None}
    target["optim"] = torch.optim.AdamW(
        [p for p in target["model"].parameters() if p.requires_grad]
    )
    with flashckpt.Checkpointer(tmp_path) as ckpt:
        ckpt.restore(target)
    for (k, v), (_, w) in zip(model.state_dict().items(), target["model"].state_dict().items()):
        assert torch.equal(v, w), k


def test_thousands_of_small_tensors_are_packed(tmp_path):
    state = {"biases": {f"b{i}": torch.full((16,), float(i)) for i in range(5000)}}
    with flashckpt.Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, state)
    assert _chunk_count(tmp_path) <= 5
    out: dict = {"biases": None}
    with flashckpt.Checkpointer(tmp_path) as ckpt:
        ckpt.restore(out)
    assert len(out["biases"]) == 5000
    assert torch.equal(out["biases"]["b4321"], torch.full((16,), 4321.0))


def test_duplicate_content_within_one_save_is_stored_once(tmp_path):
    zeros = {f"m{i}": torch.zeros(64 * 1024) for i in range(4)}  # 256 KiB each, identical
    with flashckpt.Checkpointer(tmp_path, chunk_size="256KiB") as ckpt:
        stats = ckpt.save(1, zeros).wait()
    assert _chunk_count(tmp_path) == 1
    assert stats.new_bytes == 256 * 1024 and stats.reused_bytes == 3 * 256 * 1024


def test_large_tensor_split_and_partial_change(tmp_path):
    t = torch.randn(1024 * 1024)  # 4 MiB -> 16 chunks of 256 KiB
    with flashckpt.Checkpointer(tmp_path, chunk_size="256KiB") as ckpt:
        ckpt.save(1, {"t": t})
        t[10] += 1.0  # touches exactly one chunk
        stats = ckpt.save(2, {"t": t}).wait()
    assert stats.new_bytes == 256 * 1024
    assert stats.chunks_new == 1 and stats.chunks_reused == 15
