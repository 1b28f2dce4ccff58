"""Device fingerprints (run here on CPU tensors): a flipped bit must always change them."""

from __future__ import annotations

import pytest
import torch

from flashckpt.engine.save.fingerprint import Fingerprinter

SIZES = [1, 7, 8, 9, 63, 1000, 4093, (1 << 16) + 3]


def _data(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)


def _flip(data: torch.Tensor, bit: int) -> torch.Tensor:
    out = data.clone()
    out[bit // 8] ^= 1 << (bit % 8)
    return out


@pytest.mark.parametrize("n", SIZES)
def test_any_single_flipped_bit_changes_the_fingerprint(n: int) -> None:
    fp = Fingerprinter(seeds=(12345, 67890))
    data = _data(n, seed=n)
    base = fp(data)
    nbits = n * 8
    if nbits <= 512:
        bits = list(range(nbits))  # every bit of small inputs
    else:
        g = torch.Generator().manual_seed(n + 1)
        bits = torch.randint(0, nbits, (300,), generator=g).tolist()
        bits += [0, 7, nbits - 1, nbits - 8, (n // 8) * 64 - 1]  # edges, last full word
    for bit in bits:
        flipped = fp(_flip(data, bit))
        assert flipped[0] != base[0] and flipped[1] != base[1], f"bit {bit} of {n} bytes"


@pytest.mark.parametrize("seeds", [(0, 0), (1, 2), (2**62, 2**63 - 1)])
def test_flips_detected_for_any_seed_and_all_zero_or_all_one_data(seeds: tuple[int, int]) -> None:
    fp = Fingerprinter(seeds=seeds)
    for fill in (0, 255):
        data = torch.full((4096 + 5,), fill, dtype=torch.uint8)
        base = fp(data)
        for bit in (0, 1, 8 * 4096 - 1, 8 * 4096, 8 * 4101 - 1):
            assert fp(_flip(data, bit)) != base


def test_deterministic_for_a_given_seed() -> None:
    data = _data(100_003, seed=3)
    a = Fingerprinter(seeds=(11, 22))
    b = Fingerprinter(seeds=(11, 22))
    assert a(data) == a(data) == b(data.clone())
    assert Fingerprinter(seeds=(11, 23))(data) != a(data)


def test_random_seeds_by_default() -> None:
    data = _data(4096, seed=4)
    assert Fingerprinter().seeds != Fingerprinter().seeds
    assert Fingerprinter()(data) != Fingerprinter()(data)


def test_length_is_part_of_the_fingerprint() -> None:
    fp = Fingerprinter(seeds=(5, 6))
    data = _data(13, seed=5)
    padded = torch.cat([data, torch.zeros(3, dtype=torch.uint8)])
    assert fp(data) != fp(padded)  # zero padding to a word must not hide a length change
    assert fp(torch.zeros(0, dtype=torch.uint8)) != fp(torch.zeros(8, dtype=torch.uint8))


@pytest.mark.parametrize("offset", [1, 2, 4, 8])
def test_unaligned_views_fingerprint_like_their_copy(offset: int) -> None:
    fp = Fingerprinter(seeds=(7, 8))
    backing = _data(offset + 64, seed=offset)
    view = backing[offset : offset + 64]  # length a multiple of 8, storage offset not
    assert fp(view) == fp(view.clone())
    assert fp(view) != fp(_flip(view, 100))


def test_view_of_a_wider_dtype_matches_its_bytes() -> None:
    fp = Fingerprinter(seeds=(9, 10))
    t = torch.randn(33, dtype=torch.float32)
    as_bytes = t[1:].view(torch.uint8)  # storage offset 4 bytes
    assert fp(as_bytes) == fp(as_bytes.clone())
