"""Byte quantities: parse ``"24GiB"``/``"80GB"``/ints and print them for humans (one place
for the whole package: options, CLI, planner)."""

from __future__ import annotations

import logging
import math
import re

from flashckpt.errors import ConfigError

log = logging.getLogger(__name__)

KIB = 1024
MIB = 1024**2
GIB = 1024**3

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 1000,
    "mb": 1000**2,
    "gb": 1000**3,
    "tb": 1000**4,
    "kib": KIB,
    "mib": MIB,
    "gib": GIB,
    "tib": 1024**4,
}
_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")


def parse_bytes(value: int | float | str, *, name: str = "size") -> int:
    """``value`` in bytes; accepts ints and strings such as ``"4GiB"``, ``"80GB"``, ``"512MiB"``."""
    if isinstance(value, bool):
        raise ConfigError(f"{name} must be a byte count like 4096 or '4GiB', got {value!r}")
    if isinstance(value, (int, float)):
        if value < 0:
            raise ConfigError(f"{name} must be >= 0 bytes, got {value}")
        return int(value)
    match = _SIZE_RE.match(str(value))
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise ConfigError(
            f"{name}: cannot parse {value!r}; use an int or a number with a unit "
            f"({', '.join(u for u in _UNITS if u)}), e.g. '24GiB'"
        )
    return int(float(match.group(1)) * _UNITS[unit])


def format_bytes(num_bytes: float, *, significant: int | None = None) -> str:
    """``25769803776`` -> ``'24.00 GiB'`` (binary units, two decimals), or with
    ``significant=3`` -> ``'24 GiB'`` (for chart labels)."""
    value = float(num_bytes)
    sign = "-" if value < 0 else ""
    value = abs(value)
    for unit, scale in (("TiB", 1024**4), ("GiB", GIB), ("MiB", MIB), ("KiB", KIB)):
        if value >= scale:
            num = f"{value / scale:.{significant}g}" if significant else f"{value / scale:.2f}"
            return f"{sign}{num} {unit}"
    return f"{sign}{int(value)} B"


MAX_NUMBER = 1e18  # seconds, bytes, steps read back from a journal: anything larger is garbage


def finite_number(value: object, *, limit: float = MAX_NUMBER) -> float | None:
    """``value`` as a float when it is a real number of sane size (``|v| <= limit``), else
    None: bools, strings, NaN, infinities and 401-digit integers (which overflow ``float``) are
    not numbers a journal writer produced. The one check every journal reader uses."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    if isinstance(value, int):
        return float(value) if abs(value) <= limit else None
    return value if math.isfinite(value) and abs(value) <= limit else None
