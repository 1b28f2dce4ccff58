"""Step identity: which copy of a step is the checkpoint (the one owner of that rule).

A root's steps may be held by several tiers (memory, disk, remote), and a tier may hold a copy
written by an earlier run that died: a requeued job that lands back on the node where an
earlier attempt crashed finds that attempt's memory tier, with steps a later run (on another
node) saved again differently. Tier order cannot tell the copies apart; lineage can
(:mod:`flashckpt.store.format.lineage`: every manifest records its run's generation and the
step that run branched from).

:func:`judge` takes every committed copy of one root across its tiers and decides:

1. Each generation's branch link ``g -> (parent_generation, parent_step)`` is read from its
   manifests (the link of its lowest step when they disagree). A generation whose link is
   unknown (restore was never called, a manifest from before lineage, or no copy of it is
   visible) continues into the next older generation that has copies, abandoning nothing.
2. The newest generation's chain of links is the live branch. Walking it, the bound is the
   smallest branch step seen so far: a copy ``(g, N)`` is live iff ``g`` is the newest
   generation, or ``g`` is on the chain and ``N`` <= the bound where the chain left ``g``.
   ``parent_step == -1`` (a fresh start) abandons every older generation.
3. Copies of a generation off the chain, or above its bound, are **abandoned**. When live
   copies of one step differ in generation, the highest wins; the others are **superseded**.
   Copies of the winning generation keep their tier order (fastest first).
4. A copy whose manifest could not be read (lineage ``None``) is neither: it stays a candidate
   after the step's winners, so the restore path reports its damage as before.

Pure: no file is read here (:func:`copy_lineage` is the reader the engine uses), nothing is
deleted. The engine skips, journals and removes abandoned copies (engine/restore/lineage.py).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from flashckpt.errors import FlashCkptError, ManifestError
from flashckpt.store.format.lineage import LEGACY, Lineage, parse_lineage
from flashckpt.store.format.names import step_name
from flashckpt.store.store import CheckpointStore

W = TypeVar("W", bound=Hashable)
H = TypeVar("H")

LIVE, ABANDONED, SUPERSEDED = "live", "abandoned", "superseded"


@dataclass(frozen=True, kw_only=True)
class Copy(Generic[W]):
    """One committed copy of ``step`` in tier ``where`` (an index or a name: any hashable);
    ``order`` is its tier's place, fastest first; ``lineage`` None: unreadable manifest."""

    step: int
    where: W
    order: int
    lineage: Lineage | None


@dataclass(kw_only=True)
class Judgement(Generic[W]):
    live: dict[int, list[Copy[W]]] = field(default_factory=dict)  # step -> copies, best first
    verdicts: dict[Copy[W], str] = field(default_factory=dict)
    newest: int = 0  # the newest generation among the copies
    bounds: dict[int, float] = field(default_factory=dict)  # live generation -> its max step

    @property
    def dropped(self) -> list[Copy[W]]:
        """The abandoned and superseded copies, oldest step first."""
        out = [c for c, v in self.verdicts.items() if v != LIVE]
        return sorted(out, key=lambda c: (c.step, c.order))

    def generation(self, step: int) -> int | None:
        """The generation of ``step``'s winning copy (None: no readable live copy)."""
        for c in self.live.get(step, []):
            if c.lineage is not None:
                return c.lineage.generation
        return None


def links(copies: Iterable[Copy[W]]) -> dict[int, Lineage]:
    """Each generation's branch link: that of its lowest step's copy (a writer fixes its link
    before its first save, so every copy of one generation normally agrees)."""
    first: dict[int, tuple[int, Lineage]] = {}
    for c in copies:
        lin = c.lineage
        if lin is None:
            continue
        seen = first.get(lin.generation)
        if seen is None or c.step < seen[0]:
            first[lin.generation] = (c.step, lin)
    return {g: lin for g, (_, lin) in first.items()}


def live_bounds(link: dict[int, Lineage]) -> dict[int, float]:
    """``{generation on the live branch: the highest live step of it}`` (``inf``: all)."""
    if not link:
        return {}
    gens = sorted(link)
    g = gens[-1]
    bound: float = math.inf
    out = {g: bound}
    while g > 0:
        lin = link.get(g, LEGACY)
        if lin.parent_step is not None and lin.parent_generation is not None:
            bound = min(bound, lin.parent_step)
            parent = lin.parent_generation
        else:  # unknown: the next older generation that has copies, nothing abandoned
            parent = max((x for x in gens if x < g), default=0)
        if parent >= g:  # pragma: no cover - the format forbids it (parent < generation)
            break
        g = parent
        out[g] = min(out.get(g, bound), bound)
    return out


def judge(copies: Iterable[Copy[W]]) -> Judgement[W]:
    """The verdict on every copy (see the module docstring)."""
    all_copies = list(copies)
    link = links(all_copies)
    bounds = live_bounds(link)
    out: Judgement[W] = Judgement(newest=max(link, default=0), bounds=bounds)
    winners: dict[int, int] = {}
    for c in all_copies:
        if c.lineage is None:
            continue
        g = c.lineage.generation
        if g in bounds and c.step <= bounds[g]:
            winners[c.step] = max(winners.get(c.step, -1), g)
    by_step: dict[int, list[Copy[W]]] = {}
    for c in all_copies:
        if c.lineage is None:
            verdict = LIVE
        else:
            g = c.lineage.generation
            if g not in bounds or c.step > bounds[g]:
                verdict = ABANDONED
            else:
                verdict = LIVE if winners[c.step] == g else SUPERSEDED
        out.verdicts[c] = verdict
        if verdict == LIVE:
            by_step.setdefault(c.step, []).append(c)
    for step, cs in by_step.items():
        # the winners in tier order, then unreadable copies (their load reports the damage)
        out.live[step] = sorted(cs, key=lambda c: (c.lineage is None, c.order))
    return out


def judge_held(
    held: Mapping[int, Sequence[H]], store_of: Callable[[H], CheckpointStore]
) -> tuple[dict[int, list[H]], Judgement[tuple[int, int]]]:
    """Judge ``{step: its holders, fastest tier first}`` (a holder is anything ``store_of``
    turns into its store): ``{step: the holders of its checkpoint, best first}`` and the
    judgement (a copy's ``where`` is ``(step, index in held[step])``)."""
    copies = [
        Copy(step=s, where=(s, i), order=i, lineage=copy_lineage(store_of(h), s))
        for s, hs in held.items()
        for i, h in enumerate(hs)
    ]
    verdict = judge(copies)
    live = {s: [held[s][c.where[1]] for c in cs] for s, cs in verdict.live.items()}
    return live, verdict


# A manifest this version writes starts with its lineage (Manifest.to_json): the judge reads
# the head of each copy, not the whole manifest (8 MB and a second of parsing for 50k tensors).
HEAD_BYTES = 4096


def _head_prefixes() -> tuple[bytes, ...]:
    """How a manifest of each format version this flashckpt reads opens, as it writes them."""
    from flashckpt.store.format.manifest import FORMAT, READABLE

    return tuple(
        f'{{"format":{json.dumps(FORMAT)},"version":{v},"lineage":'.encode() for v in READABLE
    )


def copy_lineage(store: CheckpointStore, step: int) -> Lineage | None:
    """The lineage of ``step``'s manifest in ``store`` (``LEGACY`` when it records none), read
    without validating the rest of the manifest (the load validates it, as always); None when
    the manifest cannot be read or its lineage is malformed (damage: the restore reports it).
    Read from the file's first :data:`HEAD_BYTES` when it starts as this version writes it; any
    other file is parsed whole."""
    from flashckpt.store.files.jsonfile import load_json
    from flashckpt.store.files.limits import MAX_MANIFEST_BYTES

    name = step_name(step)
    where = f"{store.url}/{name}"
    try:
        head = bytearray(HEAD_BYTES)
        got = store.backend.read_into(name, memoryview(head))
        found = _lineage_in_head(bytes(head[:got]), where)
        if found is not None:
            return found
        data = store.backend.read(name)
        doc = load_json(
            data, where=where, max_bytes=MAX_MANIFEST_BYTES, max_depth=None, error=ManifestError
        )
        if not isinstance(doc, dict):
            return None
        if "lineage" not in doc:
            return LEGACY
        return parse_lineage(doc["lineage"], where)
    except (OSError, FlashCkptError, ValueError, json.JSONDecodeError):
        return None


def _lineage_in_head(head: bytes, where: str) -> Lineage | None:
    """The lineage object that opens ``head`` (a manifest's first bytes), or None when the
    file does not start the way flashckpt writes manifests (then it is read whole)."""
    prefix = next((p for p in _head_prefixes() if head.startswith(p)), None)
    if prefix is None:
        return None
    text = head[len(prefix) :].decode("utf-8", errors="ignore")  # a cut last character
    try:
        obj, end = json.JSONDecoder().raw_decode(text)
    except ValueError:
        return None
    if not isinstance(obj, dict) or text[end : end + 1] != ",":
        return None
    try:
        return parse_lineage(obj, where)
    except FlashCkptError:
        return None  # read whole: the verdict is the full parser's


def newest_recorded(store: CheckpointStore) -> int:
    """The newest generation any readable manifest of ``store`` records (0: none)."""
    found = [copy_lineage(store, s) for s in store.steps()]
    return max((lin.generation for lin in found if lin is not None), default=0)
