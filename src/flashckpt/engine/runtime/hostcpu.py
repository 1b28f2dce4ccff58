"""Whether the host has a core to spare: background work that no save needs (the idle scrub,
engine/tiers/scrubbing.py) runs only on CPU that nothing else wants.

A thread at low priority still takes its share of a saturated core, and a training loop that
runs torch's thread team on every core loses a whole step's barrier to any thread that takes
one of them: on the 2-vCPU CI VM the idle scrub's 64 MiB/s of reading and hashing took 7% of a
core from a training loop that left 0.3% of the CPU idle. So before each step of such work the
governor asks :meth:`IdleCpu.busy`: the idle time of the CPUs this process may run on
(``sched_getaffinity``; ``/proc/stat``'s idle + iowait per CPU) since the last look, in cores,
must be at least :data:`MIN_IDLE_CORES`. Where ``/proc/stat`` cannot be read (not Linux) the
host is never called busy: the work runs, bounded by its own rate, as before.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable

MIN_IDLE_CORES = 0.5  # idle CPU, in cores, that idle work needs since the last look (tests: 0)
Sample = dict[int, tuple[int, int]]  # cpu -> (idle + iowait ticks, all ticks)


def read_proc_stat(path: str = "/proc/stat") -> Sample | None:
    """Per-CPU idle and total ticks, or None when the file is not there or not readable."""
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            lines = f.read(1 << 20).splitlines()
    except OSError:
        return None
    out: Sample = {}
    for line in lines:
        name, _, rest = line.partition(" ")
        if not (name.startswith("cpu") and name[3:].isdigit()):
            continue
        try:
            ticks = [int(v) for v in rest.split()]
        except ValueError:
            continue
        if len(ticks) >= 5:
            out[int(name[3:])] = (ticks[3] + ticks[4], sum(ticks[:8]))
    return out or None


def _allowed() -> set[int] | None:
    try:
        return set(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return None


class IdleCpu:
    """Idle cores since the previous look (see the module)."""

    def __init__(
        self,
        read: Callable[[], Sample | None] | None = None,
        allowed: Callable[[], set[int] | None] = _allowed,
    ) -> None:
        self._read = read or (lambda: read_proc_stat())  # looked up per call (tests patch it)
        self._allowed = allowed
        self._last: Sample | None = None
        self.idle_cores: float | None = None  # the last measured figure (status, tests)

    def busy(self) -> bool:
        """Whether fewer than :data:`MIN_IDLE_CORES` were idle since the last call. The first
        call only takes a sample and says busy (the next look measures); an unreadable
        ``/proc/stat`` is never busy."""
        if MIN_IDLE_CORES <= 0:
            return False
        now = self._read()
        if now is None:
            self._last, self.idle_cores = None, None
            return False
        last, self._last = self._last, now
        if last is None:
            return True
        cpus = self._allowed()
        idle = 0.0
        for cpu, (i1, t1) in now.items():
            if (cpus is not None and cpu not in cpus) or cpu not in last:
                continue
            i0, t0 = last[cpu]
            if t1 > t0:
                idle += max(0, i1 - i0) / (t1 - t0)
        self.idle_cores = idle
        return idle < MIN_IDLE_CORES


def run_queue_wait_s() -> float | None:
    """Seconds the calling thread has waited, runnable, for a CPU (Linux schedstat), None where
    the kernel does not say. What a save's threads take from the training thread shows here
    whatever the host's speed does to the step times: a slower or busier host stretches every
    step alike, but only threads competing for the same cores make it wait to run."""
    try:
        with open(f"/proc/self/task/{threading.get_native_id()}/schedstat", "rb") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, ValueError, IndexError, AttributeError):
        return None
