"""Byte sizes written the way people write them: ``"4GiB"``, ``"512MB"``, ``1 << 30``."""

from __future__ import annotations

import re

from flashckpt.errors import ConfigError

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 1 << 10,
    "mib": 1 << 20,
    "gib": 1 << 30,
    "tib": 1 << 40,
    "k": 1 << 10,
    "m": 1 << 20,
    "g": 1 << 30,
    "t": 1 << 40,
}
_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_bytes(value: int | str, *, name: str = "size") -> int:
    """``4096``, ``"4KiB"``, ``"1.5GB"`` -> bytes. Raises ConfigError naming ``name``."""
    if isinstance(value, bool):
        raise ConfigError(f"{name} must be a byte count like 1073741824 or '1GiB', not a bool")
    if isinstance(value, int):
        if value < 0:
            raise ConfigError(f"{name} must be >= 0, got {value}")
        return value
    if isinstance(value, str):
        m = _RE.match(value)
        if m and m.group(2).lower() in _UNITS:
            return int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    raise ConfigError(
        f"{name}={value!r} is not a size; use an int or a string like '512MiB' or '4GiB'"
    )


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"
