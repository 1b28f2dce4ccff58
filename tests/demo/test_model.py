"""The demo GPT, tokenizer, dataset and corpus."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader

from flashckpt.demo.data import CharDataset, CharTokenizer, load_corpus
from flashckpt.demo.model import GPT, Block, GPTConfig, demo_config
from flashckpt.errors import ConfigError, StateMismatchError


@pytest.fixture(scope="module")
def corpus() -> str:
    return load_corpus()


@pytest.fixture(scope="module")
def tokenizer(corpus: str) -> CharTokenizer:
    return CharTokenizer.from_text(corpus)


def _small(vocab_size: int, dropout: float = 0.0) -> GPTConfig:
    return GPTConfig(
        vocab_size=vocab_size, block_size=32, n_layer=2, n_head=2, n_embd=32, dropout=dropout
    )


def test_corpus_is_ascii_sized_and_licensed(corpus: str) -> None:
    assert 300_000 <= len(corpus) <= 600_000
    assert corpus.isascii()
    header = corpus.splitlines()[:3]
    assert "Python standard library" in header[0]
    assert "PSF License" in header[1]


def test_tokenizer_round_trip_and_state(corpus: str, tokenizer: CharTokenizer) -> None:
    sample = corpus[1000:1500]
    ids = tokenizer.encode(sample)
    assert tokenizer.decode(ids) == sample
    assert tokenizer.decode(torch.tensor(ids)) == sample
    other = CharTokenizer("ab")
    other.load_state_dict(tokenizer.state_dict())
    assert other.encode(sample) == ids
    assert tokenizer.vocab_size == len(set(corpus))


def test_tokenizer_errors(tokenizer: CharTokenizer) -> None:
    with pytest.raises(ConfigError, match="not in the vocabulary"):
        tokenizer.encode("caf\u00e9")
    with pytest.raises(ConfigError, match="ids must be in"):
        tokenizer.decode([tokenizer.vocab_size])
    with pytest.raises(ConfigError, match="repeated"):
        CharTokenizer("aa")
    with pytest.raises(StateMismatchError, match="chars"):
        tokenizer.load_state_dict({"chars": 5})


def test_dataset_windows() -> None:
    ds = CharDataset(list(range(20)), block_size=4, stride=3)
    assert len(ds) == 6  # starts 0, 3, ..., 15; the window at 15 needs ids up to 19
    x, y = ds[5]
    assert x.tolist() == [15, 16, 17, 18]
    assert y.tolist() == [16, 17, 18, 19]
    assert ds[-1][0].tolist() == x.tolist()
    with pytest.raises(IndexError):
        ds[6]
    with pytest.raises(ConfigError, match="block_size"):
        CharDataset([1, 2, 3], block_size=4)
    with pytest.raises(ConfigError, match="stride"):
        CharDataset(list(range(20)), block_size=4, stride=0)


def test_config_validation() -> None:
    with pytest.raises(ConfigError, match="divisible"):
        GPTConfig(vocab_size=10, n_embd=30, n_head=4)
    with pytest.raises(ConfigError, match="dropout"):
        GPTConfig(vocab_size=10, dropout=1.0)
    with pytest.raises(ConfigError, match="vocab_size"):
        GPTConfig(vocab_size=0)


def test_demo_config_size(tokenizer: CharTokenizer) -> None:
    config = demo_config(vocab_size=tokenizer.vocab_size)
    model = GPT(config)
    assert 1_000_000 <= model.num_params() <= 3_000_000
    assert len(model.blocks) == config.n_layer
    assert all(isinstance(b, Block) for b in model.blocks)
    assert model.lm_head.weight is model.tok_emb.weight


def test_shapes_and_block_size_limit() -> None:
    model = GPT(_small(11))
    idx = torch.randint(11, (3, 32))
    logits, loss = model(idx)
    assert logits.shape == (3, 32, 11)
    assert loss is None
    logits, loss = model(idx[:, :5], idx[:, 1:6])
    assert logits.shape == (3, 5, 11)
    assert loss is not None and loss.dim() == 0
    with pytest.raises(ConfigError, match="block_size"):
        model(torch.zeros(1, 33, dtype=torch.long))


def test_attention_is_causal() -> None:
    model = GPT(_small(11)).eval()
    idx = torch.randint(11, (1, 16))
    changed = idx.clone()
    changed[0, 10:] = (changed[0, 10:] + 1) % 11
    a, _ = model(idx)
    b, _ = model(changed)
    assert torch.allclose(a[0, :10], b[0, :10], atol=1e-5)
    assert not torch.allclose(a[0, 10:], b[0, 10:], atol=1e-5)


def _train(tokenizer: CharTokenizer, corpus: str, *, seed: int, steps: int) -> list[float]:
    torch.manual_seed(seed)
    model = GPT(_small(tokenizer.vocab_size, dropout=0.1))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    ds = CharDataset(tokenizer.encode(corpus[:60_000]), block_size=32)
    loader = DataLoader(ds, batch_size=16, shuffle=True, generator=torch.Generator().manual_seed(0))
    losses: list[float] = []
    for (x, y), _ in zip(loader, range(steps)):
        _, loss = model(x, y)
        assert loss is not None
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def test_loss_decreases_over_20_steps(tokenizer: CharTokenizer, corpus: str) -> None:
    losses = _train(tokenizer, corpus, seed=0, steps=20)
    assert len(losses) == 20
    assert sum(losses[-5:]) / 5 < losses[0] - 0.5, losses


def test_training_is_deterministic_given_the_seed(tokenizer: CharTokenizer, corpus: str) -> None:
    a = _train(tokenizer, corpus, seed=1, steps=4)
    b = _train(tokenizer, corpus, seed=1, steps=4)
    c = _train(tokenizer, corpus, seed=2, steps=4)
    assert a == b
    assert a != c
