"""A dependency-free progress bar: drawn on a terminal, silent notes-only otherwise."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
    def __init__(self, *, total: int, label: str, stream: TextIO | None = None) -> None:
        self.total = max(total, 1)
        self.label = label
        self.done = 0
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self._t0 = time.monotonic()

    def __enter__(self) -> Progress:
        self._draw()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.tty:
            self.stream.write("\r\033[K")
            self.stream.flush()

    def advance(self, n: int) -> None:
        self.done += n
        self._draw()

    def note(self, text: str) -> None:
        if self.tty:
            self.stream.write("\r\033[K")
        print(text, flush=True)
        self._draw()

    def _draw(self) -> None:
        if not self.tty:
            return
        frac = min(self.done / self.total, 1.0)
        bar = "#" * int(frac * 30)
        self.stream.write(
            f"\r{self.label} [{bar:<30}] {frac:4.0%} {time.monotonic() - self._t0:5.1f}s"
        )
        self.stream.flush()
