"""The package's version, and the moment flashckpt was first imported (a restart milestone:
engine/runtime/restart.py counts the interpreter start and the imports as parts of a restart)."""

from __future__ import annotations

import time

__version__ = "0.1.0"
IMPORTED_T = time.time()
