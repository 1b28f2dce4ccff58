"""The plan of a peer fetch (:mod:`flashckpt.distributed.replication.peerfetch`): which tier
lacks which chunk, who holds it, and who sends what to whom in each round. Built from data every
rank exchanged, so every rank computes the same plan; pure (no I/O, no collectives)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from flashckpt.errors import StorageError
from flashckpt.store.format.manifest import ChunkRef

MAX_ROUNDS = 8  # each round after the first retries with strictly fewer holders


class PeerFetchError(StorageError):
    """Chunks of a step could not be fetched from any peer's memory tier."""

    def __init__(self, message: str, *, step: int | None = None, chunk: str | None = None):
        super().__init__(message)
        self.step = step
        self.chunk = chunk


@dataclass(frozen=True, kw_only=True)
class Transfer:
    index: int
    ref: ChunkRef
    src: int  # group ranks
    dst: int

    @property
    def nbytes(self) -> int:
        return stored_size(self.ref)


def stored_size(ref: ChunkRef) -> int:
    return ref.size if ref.codec == "raw" else ref.stored_size


class FetchPlan:
    """The tiers, what each lacks and who holds it: identical on every rank."""

    def __init__(self, tiers: dict[str, list[int]], missing: dict[str, dict[str, ChunkRef]]):
        self.tiers = tiers  # identity -> its ranks
        self.missing = missing  # identity -> {hash: ref}
        self.tier_of = {r: t for t, rs in tiers.items() for r in rs}
        self.wanted: dict[str, ChunkRef] = {}
        for lack in missing.values():
            self.wanted.update(lack)
        self.held: dict[str, list[int]] = {}  # hash -> ranks holding it
        self.bad: set[int] = set()  # holders that sent damaged bytes
        self.declined: set[tuple[str, int]] = set()  # (hash, holder) that could not send
        self.rounds = 0
        self.errors: dict[int, str] = {}  # ranks that cannot take part, and why
        self.seconds = 0.0

    def unheld(self) -> list[str]:
        """Chunks some tier lacks that no other tier holds (nothing fetches them)."""
        return sorted(
            h
            for ident, lack in self.missing.items()
            for h in lack
            if not any(self.tier_of[r] != ident for r in self.held.get(h, []))
        )

    @classmethod
    def build(cls, infos: list[Any]) -> FetchPlan:
        tiers: dict[str, list[int]] = {}
        missing: dict[str, dict[str, ChunkRef]] = {}
        for r, info in enumerate(infos):
            tiers.setdefault(str(info["tier"]), []).append(r)
            lack = missing.setdefault(str(info["tier"]), {})
            for h, size, codec, stored in info["need"]:
                lack[h] = ChunkRef(hash=h, size=int(size), codec=codec, stored_size=int(stored))
        plan = cls(tiers, missing)
        plan.errors = {r: str(i["error"]) for r, i in enumerate(infos) if i.get("error")}
        return plan

    def holders(self, holds: list[Any]) -> None:
        for r, hashes in enumerate(holds):
            for h in hashes:
                self.held.setdefault(h, []).append(r)

    def missing_anywhere(self) -> bool:
        return any(self.missing.values())

    def assign(self, step: int) -> list[Transfer]:
        """This round's transfers; raises on every rank alike when a chunk has no holder."""
        self.rounds += 1
        if self.rounds > MAX_ROUNDS:
            raise PeerFetchError(f"step {step}: chunks still missing after {MAX_ROUNDS} rounds")
        sent: dict[int, int] = {}
        out: list[Transfer] = []
        for ident in sorted(self.missing):
            got: dict[int, int] = {r: 0 for r in self.tiers[ident]}
            for h, ref in sorted(self.missing[ident].items()):
                src = self._holder(h, ident, sent, step)
                dst = min(got, key=lambda r: (got[r], r))
                got[dst] += stored_size(ref)
                sent[src] = sent.get(src, 0) + stored_size(ref)
                out.append(Transfer(index=len(out), ref=ref, src=src, dst=dst))
        return out

    def _holder(self, h: str, ident: str, sent: dict[int, int], step: int) -> int:
        usable = [
            r
            for r in self.held.get(h, [])
            if r not in self.bad and (h, r) not in self.declined and self.tier_of[r] != ident
        ]
        if not usable:
            why = "every rank holding it sent damaged bytes or could not read it"
            why = why if self.held.get(h) else "no other node's memory tier holds it"
            raise PeerFetchError(
                f"chunk {h} of step {step} cannot be fetched from a peer: {why}; restore "
                "from the disk or remote tier instead",
                step=step,
                chunk=h,
            )
        return min(usable, key=lambda r: (sent.get(r, 0), r))

    def update(self, outcomes: list[Any], step: int) -> dict[int, list[str]]:
        """Take in a round's outcomes; returns ``{holder: [hashes it sent damaged]}``."""
        errors = [f"rank {r}: {o['error']}" for r, o in enumerate(outcomes) if o["error"]]
        if errors:
            raise PeerFetchError(
                f"step {step}: writing fetched chunks failed ({'; '.join(errors)})"
            )
        damaged: dict[int, list[str]] = {}
        for o in outcomes:
            for h, r in o["bad"]:
                self.bad.add(int(r))
                damaged.setdefault(int(r), []).append(h)
            self.declined.update((h, int(r)) for h, r in o["declined"])
        for o in outcomes:
            lack = self.missing[self.tier_of[int(o["rank"])]]
            for h in o["done"]:
                lack.pop(h, None)
        return damaged
