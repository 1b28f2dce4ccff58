"""Shared helpers for tests/memory: the benchmark's model definitions, small shapes."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest
import torch

from flashckpt.memory import TransformerShape

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "memory_accuracy.py"


def _load_bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("memory_accuracy", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def bench() -> ModuleType:
    """benchmarks/memory_accuracy.py: LM (GPT-2 / Llama-style) used on the GPU, here on CPU."""
    return _load_bench()


GPT_TINY = TransformerShape(3, 64, 4, 97, max_seq_len=32, name="gpt-tiny")
LLAMA_TINY = TransformerShape(
    3,
    64,
    4,
    97,
    ffn_hidden=96,
    kv_heads=2,
    tied_embeddings=False,
    mlp="swiglu",
    norm="rmsnorm",
    bias=False,
    positions="rope",
    max_seq_len=32,
    name="llama-tiny",
)


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)
