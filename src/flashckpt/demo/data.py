"""The demo's data: a character tokenizer and fixed-stride windows over the shipped corpus.

The corpus (``corpus.txt``, about 500 KB of ASCII) is docstrings from the Python standard
library, distributed under the PSF License; its first three lines say so.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from importlib import resources
from typing import Any

import torch
from torch.utils.data import Dataset

from flashckpt.errors import ConfigError, StateMismatchError

logger = logging.getLogger(__name__)

CORPUS_FILE = "corpus.txt"


def load_corpus() -> str:
    """The shipped corpus as one string (read through ``importlib.resources``)."""
    return resources.files("flashckpt.demo").joinpath(CORPUS_FILE).read_text(encoding="ascii")


class CharTokenizer:
    """Maps each distinct character of a text to an id (sorted by code point).

    ``state_dict()`` is ``{"chars": str}``, JSON-able, so the tokenizer can be saved with the
    run and a resumed run decodes with exactly the same vocabulary.
    """

    def __init__(self, chars: str) -> None:
        if not isinstance(chars, str) or not chars:
            raise ConfigError("CharTokenizer: chars must be a non-empty str of distinct chars")
        if len(set(chars)) != len(chars):
            raise ConfigError("CharTokenizer: chars has repeated characters; use from_text()")
        self.chars = chars
        self._ids = {ch: i for i, ch in enumerate(chars)}

    @classmethod
    def from_text(cls, text: str) -> CharTokenizer:
        """A tokenizer whose vocabulary is every character in ``text``."""
        return cls("".join(sorted(set(text))))

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> list[int]:
        """Ids of the characters of ``text``; unknown characters raise ConfigError."""
        try:
            return [self._ids[ch] for ch in text]
        except KeyError as exc:
            raise ConfigError(
                f"CharTokenizer.encode: character {exc.args[0]!r} is not in the vocabulary "
                f"of {self.vocab_size} characters; build the tokenizer from text containing it"
            ) from None

    def decode(self, ids: Iterable[int] | torch.Tensor) -> str:
        """The text for ``ids`` (a sequence of ints or a 1-D integer tensor)."""
        values = ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
        if any(not 0 <= int(i) < self.vocab_size for i in values):
            raise ConfigError(f"CharTokenizer.decode: ids must be in [0, {self.vocab_size})")
        return "".join(self.chars[int(i)] for i in values)

    def state_dict(self) -> dict[str, Any]:
        return {"chars": self.chars}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        chars = state_dict.get("chars") if isinstance(state_dict, Mapping) else None
        if not isinstance(chars, str) or not chars or len(set(chars)) != len(chars):
            raise StateMismatchError(
                "CharTokenizer state must be {'chars': str of distinct characters}",
                keys=["chars"],
            )
        self.chars = chars
        self._ids = {ch: i for i, ch in enumerate(chars)}


class CharDataset(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Windows ``(x, y)`` of ``block_size`` token ids; ``y`` is ``x`` shifted by one.

    Window ``i`` starts at ``i * stride`` (default ``stride = block_size``: no overlap), so the
    dataset is a pure function of the tokens and its length is fixed, as a resumable sampler
    needs.
    """

    def __init__(
        self,
        tokens: Sequence[int] | torch.Tensor,
        *,
        block_size: int,
        stride: int | None = None,
    ) -> None:
        stride = block_size if stride is None else stride
        for name, value in (("block_size", block_size), ("stride", stride)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"CharDataset: {name} must be an int >= 1, got {value!r}")
        data = torch.as_tensor(tokens, dtype=torch.long)
        if data.dim() != 1 or data.numel() < block_size + 1:
            raise ConfigError(
                f"CharDataset: tokens must be 1-D with at least block_size + 1 = "
                f"{block_size + 1} ids, got shape {tuple(data.shape)}"
            )
        self.data = data
        self.block_size = block_size
        self.stride = stride

    def __len__(self) -> int:
        return (self.data.numel() - self.block_size - 1) // self.stride + 1

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not -len(self) <= index < len(self):
            raise IndexError(f"CharDataset index {index} out of range for length {len(self)}")
        start = (index % len(self)) * self.stride
        chunk = self.data[start : start + self.block_size + 1]
        return chunk[:-1], chunk[1:]


__all__ = ["CharDataset", "CharTokenizer", "load_corpus"]
