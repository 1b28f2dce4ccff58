"""What the runtime helpers (``should_save``'s cadence, preemption) may call on the Checkpointer.

They act on the Checkpointer that owns them, but importing it would make each of them and the
Checkpointer import the other. This Protocol is the part of its face they use; the Checkpointer
satisfies it, and mypy checks that where it hands itself over.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

from flashckpt.engine.save.handle import SaveHandle
from flashckpt.journal import Journal
from flashckpt.policy.save import SavePolicy


class Facade(Protocol):
    save_policy: SavePolicy | None
    journal: Journal

    @property
    def last_step(self) -> int | None: ...

    def has_step(self, step: int) -> bool: ...

    def save(self, step: int, state: Mapping[str, Any]) -> SaveHandle: ...

    def close(self) -> None: ...

    def _wait_current(self) -> None: ...
