"""Lineage: which run wrote a checkpoint, and the checkpoint that run branched from.

Every manifest and rank part written by this version carries::

    "lineage": {"generation": g, "parent_generation": p | null, "parent_step": s | null}

* ``generation``: the writer's run generation, taken once per writer from ``ROOT/generation``
  (:mod:`flashckpt.store.generation`): 1 for the first writer of a root, then 2, 3, ...
* ``parent_generation`` / ``parent_step``: where the run branched: ``restore()`` returned step
  ``s`` of generation ``p``. ``parent_step == -1``: ``restore()`` found nothing (a fresh start,
  every older generation is abandoned). ``parent_step`` null: ``restore()`` was never called
  (unknown: the run abandons nothing), ``parent_generation`` is then the previous generation.

A manifest without ``lineage`` (written before it existed) is generation 0 with an unknown
parent (:data:`LEGACY`). A reader that predates lineage ignores the field (it reads named keys
only), so the format version stays 1. :mod:`flashckpt.store.lineage` decides with it which copy
of a step is the checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from flashckpt.errors import ManifestError

MAX_GENERATION = 10**15
MAX_STEP = 10**15  # the manifest's own bound on a step
_KEYS = {"generation", "parent_generation", "parent_step"}


@dataclass(frozen=True, kw_only=True)
class Lineage:
    generation: int
    parent_generation: int | None = None
    parent_step: int | None = None  # -1: a fresh start; None: unknown (restore never called)

    def __post_init__(self) -> None:
        problem = _problem(self.generation, self.parent_generation, self.parent_step)
        if problem:
            raise ValueError(problem)

    @property
    def known(self) -> bool:
        """True when the branch point is known (a restore, or a fresh start)."""
        return self.parent_step is not None

    def to_json(self) -> dict[str, Any]:
        return {
            "generation": self.generation,
            "parent_generation": self.parent_generation,
            "parent_step": self.parent_step,
        }


def _int(v: Any, lo: int, hi: int) -> bool:
    return type(v) is int and lo <= v <= hi


def _problem(gen: Any, pgen: Any, pstep: Any) -> str | None:
    if not _int(gen, 0, MAX_GENERATION):
        return f"generation {gen!r} is not an integer in [0, {MAX_GENERATION}]"
    if pgen is not None and not _int(pgen, 0, max(gen - 1, 0)):
        return f"parent_generation {pgen!r} is not an integer in [0, {max(gen - 1, 0)}]"
    if pstep is not None and not _int(pstep, -1, MAX_STEP):
        return f"parent_step {pstep!r} is not null or an integer in [-1, {MAX_STEP}]"
    if pstep is not None and pgen is None:
        return "parent_step is given without its parent_generation"
    if gen == 0 and (pgen is not None or pstep is not None):
        return "generation 0 (before lineage) has no parent"
    return None


LEGACY = Lineage(generation=0)  # a manifest written before lineage existed


def parse_lineage(v: Any, where: str) -> Lineage:
    """The ``lineage`` object of a manifest, strictly validated (exactly the three keys)."""
    if type(v) is not dict or set(v) != _KEYS:
        raise ManifestError(
            f"{where}: 'lineage' must be an object with exactly the keys "
            f"{sorted(_KEYS)}, got {v!r:.200}"
        )
    gen, pgen, pstep = v["generation"], v["parent_generation"], v["parent_step"]
    problem = _problem(gen, pgen, pstep)
    if problem is None and gen == 0:
        problem = "generation 0 is never written (it means: before lineage)"
    if problem:
        raise ManifestError(f"{where}: lineage: {problem}")
    return Lineage(generation=gen, parent_generation=pgen, parent_step=pstep)
