"""Byte quantities for the planner: the package-wide helpers in :mod:`flashckpt.units`."""

from flashckpt.units import GIB, KIB, MIB, format_bytes, parse_bytes

__all__ = ["GIB", "KIB", "MIB", "format_bytes", "parse_bytes"]
