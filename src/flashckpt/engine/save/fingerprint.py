"""Device-side chunk fingerprints: decide "unchanged" without copying a chunk to the host.

With ``incremental=True`` on CUDA, each chunk's bytes are fingerprinted on the GPU and compared
with the fingerprint the same region had at the previous save; only changed chunks are copied to
the host, hashed (xxh3-128) and written.

The fingerprint is two independent 64-bit lanes. Each lane maps every 8-byte word ``w_i`` at
position ``i`` to ``mix(w_i + i*K + seed)`` with the SplitMix64 finaliser (a bijection on 64-bit
integers) and sums the results modulo 2**64. Properties:

* a change confined to one word (any number of flipped bits in it) *always* changes both lanes:
  the word's mixed value changes because ``mix`` is a bijection, and addition modulo 2**64 is
  injective in each term;
* for changes in several words, a false "unchanged" needs both 64-bit sums to cancel; with the
  per-process random seeds that is about 2**-128 for data not built to defeat this exact
  function, far below the rate of undetected disk or memory errors;
* the comparison is only ever against the same region of the same tensor at the previous save
  in this process, and a chunk is reused only if the store still holds its hash.

Logical right shifts are emulated with masks because torch shifts signed integers
arithmetically, which would not be a bijection.
"""

from __future__ import annotations

import secrets

import torch

_C1 = -0x40A7B892E31B1A47  # 0xBF58476D1CE4E5B9 as signed int64
_C2 = -0x6B2FB644ECCEEE15  # 0x94D049BB133111EB
_K = -0x61C8864680B583EB  # 0x9E3779B97F4A7C15 (golden ratio)


def _srl(x: torch.Tensor, s: int) -> torch.Tensor:
    return (x >> s) & ((1 << (64 - s)) - 1)


def _mix(z: torch.Tensor) -> torch.Tensor:
    z = (z ^ _srl(z, 30)) * _C1
    z = (z ^ _srl(z, 27)) * _C2
    return z ^ _srl(z, 31)


class Fingerprinter:
    """Computes 128-bit fingerprints of byte tensors on their own device."""

    def __init__(self, seeds: tuple[int, int] | None = None) -> None:
        if seeds is None:
            seeds = (secrets.randbits(63), secrets.randbits(63))
        self.seeds = seeds

    def __call__(self, data: torch.Tensor) -> tuple[int, int]:
        """Fingerprint of a flat uint8 tensor (any device)."""
        n = data.numel()
        pad = (-n) % 8
        if pad or data.storage_offset() % 8 or not data.is_contiguous():
            # cat copies into a fresh (aligned) tensor: a view of a tensor that starts at a byte
            # offset not divisible by 8 cannot be reinterpreted as int64 words in place
            data = torch.cat([data, torch.zeros(pad, dtype=torch.uint8, device=data.device)])
        words = data.view(torch.int64)
        pos = torch.arange(words.numel(), dtype=torch.int64, device=data.device) * _K
        lanes = []
        for seed in self.seeds:
            lanes.append(int(_mix(words + pos + seed).sum(dtype=torch.int64).item()))
        return (lanes[0] ^ (n << 1), lanes[1])
