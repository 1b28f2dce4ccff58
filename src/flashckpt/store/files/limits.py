"""How large a valid file of each kind under a root can be (no I/O here).

A reader refuses a larger file before reading a byte of it: its size comes from ``fstat`` on
the open descriptor (a sparse file counts at the size it claims), see
:func:`flashckpt.store.files.safeopen.read_fd`. The format (store/format) names the same
limits when it validates what it parsed.
"""

from __future__ import annotations

MAX_MANIFEST_BYTES = 1 << 30  # a manifest or a rank's part
MAX_CHUNK_BYTES = 1 << 34
MAX_PIN_BYTES = MAX_MANIFEST_BYTES  # a pin lists at most the chunks of one manifest
MAX_SMALL_FILE_BYTES = 64 << 20  # anything else under a root: root-id, tiers.json, records
_BY_DIR = {"steps": MAX_MANIFEST_BYTES, "pins": MAX_PIN_BYTES, "chunks": MAX_CHUNK_BYTES}


def read_limit(path: str) -> int:
    """The most bytes a valid file at ``path`` (relative to a root) can hold."""
    return _BY_DIR.get(path.partition("/")[0], MAX_SMALL_FILE_BYTES)
