"""Argument types shared by every command: one function per kind of number, so that a NaN, an
infinity, a negative or an absurd value is refused by argparse (exit 2, one line naming the
option) before any command sees it.

``float("nan")`` and ``float("inf")`` parse as floats, and ``int`` takes 400-digit numbers:
``type=float`` alone let ``chaos --minutes nan`` hang and ``--mtbf-s inf`` divide by zero.
"""

from __future__ import annotations

import argparse
import math
import re
from collections.abc import Callable

from flashckpt.engine.options import MAX_STEP


def real(
    *, low: float, high: float, low_open: bool = False, what: str = "a number"
) -> Callable[[str], float]:
    """A float type: finite, ``low <= v <= high`` (``low < v`` with ``low_open``)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        below = value <= low if low_open else value < low
        if not math.isfinite(value) or below or value > high:
            bound = f"{'>' if low_open else '>='} {low:g} and <= {high:g}"
            raise argparse.ArgumentTypeError(f"{text!r}: expected {what}, finite, {bound}")
        return value

    parse.__name__ = what.replace(" ", "_")
    return parse


def integer(*, low: int, high: int, what: str = "an integer") -> Callable[[str], int]:
    """An int type: ``low <= v <= high`` (digits only, at most 20 of them)."""

    def parse(text: str) -> int:
        if not re.fullmatch(r"[+-]?[0-9]{1,20}", text.strip()):
            raise argparse.ArgumentTypeError(f"{text[:40]!r} is not {what} (ASCII digits)")
        value = int(text)
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{text!r}: expected {what} in {low}..{high}")
        return value

    parse.__name__ = what.replace(" ", "_")
    return parse


# the kinds the commands use
step = integer(low=0, high=MAX_STEP, what="a step")
count = integer(low=1, high=1 << 31, what="a count >= 1")
count0 = integer(low=0, high=1 << 31, what="a count >= 0")
seed = integer(low=0, high=(1 << 63) - 1, what="a seed")
price = real(low=0.0, high=1e9, what="a price")
fraction = real(low=0.0, high=1.0, low_open=True, what="a fraction")
minutes = real(low=0.0, high=7 * 24 * 60, low_open=True, what="minutes")  # up to a week
mtbf_s = real(low=1.0, high=1e9, what="seconds between failures")  # below 1 s: only kills
size_gb = real(low=0.0, high=1 << 20, low_open=True, what="gigabytes")
