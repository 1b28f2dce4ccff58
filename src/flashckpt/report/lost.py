"""Restores and the steps redone after crashes, folded one primary event at a time.

A restore is counted once per restore, however many ``restore`` events it journals: the HF
integration, for one, restores the model, the optimizer and the RNG of one step separately, at
the moments the Trainer asks for them. Consecutive ``restore`` events of the same step from the
same process (no save or run start in between) are one restore, their seconds summed.

Steps lost after a crash are the last step the crashed run is known to have reached minus the
step restored next. The evidence is the ``crash_detected`` event's ``last_step`` (the run
marker's last tick), the engine's ``steps_lost``, and any step-carrying event of the crashed run
(``step`` ticks — one ``{"event": "step", "step": n}`` per training step or every few — as well
as ``step_time``, ``save_start``, ``staged``); the largest wins.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from flashckpt.units import finite_number

Event = Mapping[str, Any]
_STEP_EVIDENCE = frozenset(("step", "step_time", "save_start", "staged"))


class RestoreFold:
    """One ``{"t", "step", "seconds", "parts"}`` per restore (see the module docstring)."""

    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []
        self._open: tuple[Any, Any] | None = None

    def add(self, e: Event) -> None:
        name = e.get("event")
        if name in ("save_start", "run_start", "crash_detected"):
            self._open = None
        if name != "restore":
            return
        key = (e.get("pid"), e.get("step"))
        secs = finite_number(e.get("seconds")) or 0.0
        if key == self._open and self.rows:
            self.rows[-1]["seconds"] += secs
            self.rows[-1]["parts"] += 1
        else:
            self.rows.append(
                {"t": float(e["t"]), "step": e.get("step"), "seconds": secs, "parts": 1}
            )
            self._open = key


class LostFold:
    """Steps redone after crashes (see the module docstring for the evidence used)."""

    def __init__(self) -> None:
        self.crashes: list[dict[str, float | None]] = []
        self.loose = 0.0  # steps_lost events without a crash event before them
        self.reached: float | None = None  # the furthest step the current run reached
        self.before: float | None = None  # the same for the run before the latest run_start

    def add(self, e: Event) -> None:
        name, step = e.get("event"), finite_number(e.get("step"))
        crashes = self.crashes
        if name == "crash_detected":  # journaled next to the new run's run_start, either order
            evidence = (self.reached, self.before, finite_number(e.get("last_step")))
            seen = [v for v in evidence if v is not None]
            crashes.append({"reach": max(seen) if seen else None, "restored": None, "n": 0.0})
            self.reached = self.before = None
        elif name == "run_start":
            self.reached, self.before = None, self.reached
        elif name == "steps_lost":
            n = finite_number(e.get("steps")) or 0.0
            if crashes:
                crashes[-1]["n"] = max(crashes[-1]["n"] or 0.0, n)
            else:
                self.loose += n
        elif name == "restore" and crashes and crashes[-1]["restored"] is None:
            crashes[-1]["restored"] = step
        if name in _STEP_EVIDENCE and step is not None:
            self.reached = step if self.reached is None else max(self.reached, step)

    def steps(self) -> int:
        lost = self.loose
        for c in self.crashes:
            reach, restored = c["reach"], c["restored"]
            marker = (
                max(0.0, reach - restored) if reach is not None and restored is not None else 0.0
            )
            lost += max(marker, c["n"] or 0.0)
        return int(lost)
