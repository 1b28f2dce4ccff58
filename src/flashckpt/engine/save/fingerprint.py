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


WINDOW_BYTES = 4 << 20
"""Bytes fingerprinted per step: the temporaries (a few int64 words per 8 bytes of data) are
bounded by a few windows, not a few chunks, on the side stream's share of the caching
allocator (which keeps freed blocks per stream)."""


class Fingerprinter:
    """Computes 128-bit fingerprints of byte tensors on their own device."""

    def __init__(self, seeds: tuple[int, int] | None = None) -> None:
        if seeds is None:
            seeds = (secrets.randbits(63), secrets.randbits(63))
        self.seeds = seeds

    def __call__(self, data: torch.Tensor) -> tuple[int, int]:
        """Fingerprint of a flat uint8 tensor (any device)."""
        return self.of_parts([data])

    def of_parts(self, parts: list[torch.Tensor]) -> tuple[int, int]:
        """Fingerprint of the concatenation of flat uint8 tensors (all on one device), taken
        window by window: each window is a view of the data in place when it lies in one
        part at a word boundary, else its bytes are gathered into one window buffer (never
        a copy of the whole chunk). Equal to the fingerprint of the concatenated bytes."""
        n = sum(p.numel() for p in parts)
        dev = parts[0].device if parts else torch.device("cpu")
        acc = [torch.zeros((), dtype=torch.int64, device=dev) for _ in self.seeds]
        window = max(8, WINDOW_BYTES - WINDOW_BYTES % 8)
        scratch: torch.Tensor | None = None
        for lo in range(0, n, window):
            hi = min(n, lo + window)
            words = _in_place(parts, lo, hi)
            if words is None:
                if scratch is None:
                    scratch = torch.empty(window, dtype=torch.uint8, device=dev)
                words = _gather(parts, lo, hi, scratch)
            for lane, seed in zip(acc, self.seeds):
                z = torch.arange(lo // 8, lo // 8 + words.numel(), dtype=torch.int64, device=dev)
                z.mul_(_K).add_(words).add_(seed)
                lane.add_(_mix_(z).sum(dtype=torch.int64))
        lanes = [int(a.item()) for a in acc]
        return (lanes[0] ^ (n << 1), lanes[1])


def _in_place(parts: list[torch.Tensor], lo: int, hi: int) -> torch.Tensor | None:
    """Bytes ``lo:hi`` as int64 words viewing the data itself, or None when they cannot."""
    pos = 0
    for p in parts:
        if lo >= pos and hi <= pos + p.numel():
            piece = p[lo - pos : hi - pos]
            aligned = (hi - lo) % 8 == 0 and piece.storage_offset() % 8 == 0
            if aligned and piece.is_contiguous():
                return piece.view(torch.int64)
            return None
        pos += p.numel()
    return None


def _gather(parts: list[torch.Tensor], lo: int, hi: int, scratch: torch.Tensor) -> torch.Tensor:
    """Bytes ``lo:hi`` copied into ``scratch``, zero-padded to whole words."""
    size = hi - lo + (-(hi - lo)) % 8
    out = scratch[:size]
    out.zero_()
    pos, at = 0, 0
    for p in parts:
        a, b = max(lo, pos), min(hi, pos + p.numel())
        if a < b:
            out[at : at + b - a].copy_(p[a - pos : b - pos])
            at += b - a
        pos += p.numel()
    return out.view(torch.int64)


def _mix_(z: torch.Tensor) -> torch.Tensor:
    """:func:`_mix` in place (one temporary for the shifted copy)."""
    for shift, mul in ((30, _C1), (27, _C2), (31, None)):
        z.bitwise_xor_(_srl(z, shift))
        if mul is not None:
            z.mul_(mul)
    return z
