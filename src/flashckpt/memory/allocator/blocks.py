"""What PyTorch's CUDA caching allocator reserves for the tensors a step keeps live.

The rules (c10/cuda/CUDACachingAllocator.cpp) that turn tensor bytes into reserved bytes:

* every block is rounded up to a multiple of 512 bytes (``kMinBlockSize``), at least 512;
* with ``expandable_segments:True`` (what :func:`flashckpt.memory.preallocate` sets) a pool's
  segment grows in 2 MiB pages, so beyond the blocks a pool wastes less than one page: the
  small pool (blocks of at most 1 MiB) and the large pool, one page each;
* without them a block over 10 MiB (``kMinLargeAlloc``) gets its own segment rounded up to
  2 MiB (``kRoundLarge``); smaller blocks are carved out of shared 2 MiB (``kSmallBuffer``, for
  blocks up to 1 MiB) and 20 MiB (``kLargeBuffer``) segments, one of each partly empty.

:func:`reserved_bytes` of one tensor and :func:`pool_slack` of a whole step are what the traced
estimate adds to the live bytes it meters (its fragmentation margin), in place of a flat share.
Fragmentation from the order of frees and reuse (a freed block too small for the next request)
is not modelled; expandable segments remove most of it.
"""

from __future__ import annotations

MIN_BLOCK = 512
MIN_LARGE_ALLOC = 10 << 20
ROUND_LARGE = 2 << 20
SMALL_BUFFER = 2 << 20
LARGE_BUFFER = 20 << 20
PAGE = 2 << 20  # an expandable segment's mapping granularity


def block_bytes(nbytes: int) -> int:
    """The allocator's block for a request of ``nbytes`` (what ``memory_allocated`` counts)."""
    if nbytes <= 0:
        return 0
    return max(MIN_BLOCK, -(-nbytes // MIN_BLOCK) * MIN_BLOCK)


def reserved_bytes(nbytes: int, *, expandable: bool) -> int:
    """What a live tensor of ``nbytes`` holds of reserved memory (its own segment's rounding
    included when it has one)."""
    block = block_bytes(nbytes)
    if not expandable and block > MIN_LARGE_ALLOC:
        return -(-block // ROUND_LARGE) * ROUND_LARGE
    return block


def pool_slack(*, expandable: bool) -> int:
    """The partly empty segments a step's pools hold beyond their blocks."""
    return 2 * PAGE if expandable else SMALL_BUFFER + LARGE_BUFFER
