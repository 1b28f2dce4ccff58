"""A pid per simulated process (the simulation's crash ends a *generation*, not the test's
process).

A pin names its writer by pid (``ROOT/pins/<host>-<pid>-<n>.json``) and gc expires the pins of a
writer that is gone, a torn one included (store/pins.py). Every simulated process used to write
pins under the test's own pid, which never dies: a pin torn by a simulated process that then
crashed made every later gc refuse (seed 13 of the 10,000-operation run, op 11). Here each
generation gets a real pid of its own: a ``sleep`` child started with the generation and
SIGKILLed (and reaped) when it ends, and the pins module sees that pid as ``os.getpid()`` while
``plan.generation`` is that generation. Nothing in the library is edited.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from typing import Any

from flashckpt.store import pins


class _PinOs:
    """``os`` as store/pins.py sees it: the simulated process's pid, the rest unchanged."""

    def __init__(self, pid: Any) -> None:
        self._pid = pid

    def getpid(self) -> int:
        return int(self._pid())

    def __getattr__(self, name: str) -> Any:
        return getattr(os, name)


class SimPids:
    def __init__(self, plan: Any) -> None:
        self.plan = plan
        self._procs: dict[int, subprocess.Popen[bytes]] = {}

    def start(self, generation: int) -> None:
        if generation not in self._procs:
            self._procs[generation] = subprocess.Popen(["sleep", "86400"])

    def end(self, generation: int) -> None:
        """The simulated process is gone: its pid is no longer alive (killed and reaped)."""
        proc = self._procs.pop(generation, None)
        if proc is not None:
            proc.kill()
            proc.wait(timeout=30)

    def pid(self) -> int:
        proc = self._procs.get(self.plan.generation)
        return proc.pid if proc is not None else os.getpid()  # the CLI's "process": this one

    def close(self) -> None:
        for g in list(self._procs):
            self.end(g)


@contextlib.contextmanager
def simulated_pids(plan: Any) -> Iterator[SimPids]:
    sim = SimPids(plan)
    real = pins.os
    pins.os = _PinOs(sim.pid)  # type: ignore[assignment]
    try:
        yield sim
    finally:
        pins.os = real
        sim.close()
