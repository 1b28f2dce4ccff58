"""A leader-based store barrier that carries errors: O(world) Store requests per phase in total.

Numbered script of one phase ``P`` under the barrier's ``prefix`` (every rank runs it):

1. Post: ``set(P/v<rank>, status)`` then ``n = add(P/n, 1)``; the rank that makes ``n`` equal
   the world size sets ``P/full``.
2. The leader (rank 0) waits on ``P/full`` (one blocking ``wait``), reads every status with one
   ``multi_get``, optionally computes a decision from them (the save tier, a verdict) and
   proposes ``{"values": [...], "decision": ...}`` as the phase result.
3. Every other rank waits on ``P/result`` (one blocking ``wait``) and reads it.
4. The result is set with ``compare_set(P/result, "", proposal)``: the first proposal wins and
   every rank reads the same one. A leader that times out on ``P/full`` proposes an abort naming
   the ranks that never posted; a rank that times out waiting for a leader that never posted
   proposes an abort naming the leader (when the leader did post, it waits one more
   ``timeout_s`` for the leader's verdict, so a barrier ends within ``2 x timeout_s``). A late
   rank reads the decided abort and raises the same error as everyone else.

So each rank makes four or five requests per phase whatever the world size (the leader about
as many plus one ``multi_get`` of ``world`` values and the deletes below), instead of every
waiting rank polling every missing one. It uses only Store requests, never a collective, so it
may run on a background thread while training runs collectives. The keys of a phase are deleted
by the leader once every rank has posted the next phase, the last phase's by the next barrier
of the same context (:meth:`leftover_keys`): ``world + 3`` deletes per phase, all on the leader.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from flashckpt.errors import DistributedError

log = logging.getLogger(__name__)

LEADER = 0
Decide = Callable[[list[dict[str, Any]]], Any]


@dataclass(kw_only=True)
class StoreBarrier:
    """Exchanges statuses between ``world_size`` ranks under a key ``prefix``.

    Contract, for each call of :meth:`exchange` / :meth:`decide` (every rank calls with the same
    phases in the same order): 1. post this rank's value; 2. wait for the one result of the
    phase (all values, or an abort); 3. return the values by rank (and the leader's decision),
    or raise the same :class:`DistributedError` on every rank.
    """

    store: Any
    rank: int
    world_size: int
    timeout_s: float
    prefix: str
    timed_out: bool = False  # set when a rank never arrived or the store failed
    missing: list[int] = field(default_factory=list)  # the ranks a timeout named
    cleanup: list[str] = field(default_factory=list)  # leader: keys of an earlier barrier
    _prev: str | None = None  # base of the previous phase (its control keys)

    def exchange(self, phase: str, value: dict[str, Any]) -> list[dict[str, Any]]:
        """Post ``value`` for ``phase`` and return every rank's value, in rank order."""
        return self.decide(phase, value)[0]

    def decide(
        self, phase: str, value: dict[str, Any], decide: Decide | None = None
    ) -> tuple[list[dict[str, Any]], Any]:
        """Like :meth:`exchange`, plus ``decide(values)`` computed on the leader and returned on
        every rank. A ``decide`` that raises counts as a failure of the leader in this phase."""
        base = f"{self.prefix}/{phase}"
        mine = f"{base}/v{self.rank}"
        self._call(phase, self.store.set, mine, json.dumps(value).encode())
        if self._call(phase, self.store.add, f"{base}/n", 1) == self.world_size:
            self._call(phase, self.store.set, f"{base}/full", b"1")
        if self.rank == LEADER:
            result = self._lead(phase, base, decide)
        else:
            result = self._follow(phase, base)
        self._prev = base
        if "missing" in result:
            raise self._timeout(phase, result)
        return list(result["values"]), result.get("decision")

    def agree(
        self, phase: str, error: str | None, *, step: int | None = None, hint: str = ""
    ) -> None:
        """Barrier: raise the same :class:`DistributedError` everywhere if any rank failed."""
        values = self.exchange(phase, {"ok": error is None, "error": error or ""})
        raise_failed(values, phase=phase, step=step, hint=hint)

    def leftover_keys(self) -> list[str]:
        """The control keys of the last phase, for the next barrier's leader to delete once
        every rank has moved on."""
        if self._prev is None:
            return []
        keys = [f"{self._prev}/v{r}" for r in range(self.world_size)]
        return keys + [f"{self._prev}/{k}" for k in ("n", "full", "result")]

    # -- the two roles -----------------------------------------------------------------------
    def _lead(self, phase: str, base: str, decide: Decide | None) -> dict[str, Any]:
        if not self._wait(phase, f"{base}/full", self.timeout_s):
            missing = [
                r
                for r in range(self.world_size)
                if not self._call(phase, self.store.check, [f"{base}/v{r}"])
            ]
            proposal: dict[str, Any] = {"missing": missing or [LEADER], "by": self.rank}
        elif self._call(phase, self.store.check, [f"{base}/result"]):  # others gave up on us
            return _decode_result(self._call(phase, self.store.get, f"{base}/result"))
        else:
            keys = [f"{base}/v{r}" for r in range(self.world_size)]
            values = [_decode(raw) for raw in self._call(phase, self.store.multi_get, keys)]
            proposal = {"values": values, "decision": None}
            if decide is not None:
                try:
                    proposal["decision"] = decide(values)
                except Exception as exc:
                    err = f"deciding for all ranks: {type(exc).__name__}: {exc}"
                    values[LEADER] = {**values[LEADER], "ok": False, "error": err}
        result = self._settle(phase, base, proposal)
        if "values" in proposal:  # every rank posted this phase: earlier keys are unread now
            self._delete_previous()
        return result

    def _follow(self, phase: str, base: str) -> dict[str, Any]:
        key = f"{base}/result"
        if self._wait(phase, key, self.timeout_s):
            return _decode_result(self._call(phase, self.store.get, key))
        leader_posted = self._call(phase, self.store.check, [f"{base}/v{LEADER}"])
        if leader_posted and self._wait(phase, key, self.timeout_s):
            return _decode_result(self._call(phase, self.store.get, key))
        why = "arrived but never decided" if leader_posted else "never arrived"
        proposal = {"missing": [LEADER], "by": self.rank, "leader": why}
        return self._settle(phase, base, proposal)

    def _settle(self, phase: str, base: str, proposal: dict[str, Any]) -> dict[str, Any]:
        """Propose the phase's result; the first proposal of any rank is everyone's."""
        raw = json.dumps(proposal).encode()
        return _decode_result(self._call(phase, self.store.compare_set, f"{base}/result", b"", raw))

    # -- helpers ------------------------------------------------------------------------------
    def _wait(self, phase: str, key: str, timeout_s: float) -> bool:
        """True once ``key`` exists, False after ``timeout_s``; a dead store raises."""
        try:
            self.store.wait([key], timedelta(seconds=timeout_s))
            return True
        except Exception as exc:  # a timeout, or the store is gone: check tells them apart
            log.debug("waiting for %s: %s", key, exc)
        return bool(self._call(phase, self.store.check, [key]))

    def _timeout(self, phase: str, result: dict[str, Any]) -> DistributedError:
        self.timed_out = True
        missing = [int(r) for r in result.get("missing", [])]
        self.missing = missing
        what = "never arrived (crashed, hung or far behind)"
        if result.get("leader") == "arrived but never decided":
            what = "arrived but never decided (hung)"
        return DistributedError(
            f"timeout after {self.timeout_s:g}s in phase {phase!r}: rank(s) {missing} {what}; "
            "nothing was published by this phase. Raise dist_timeout_s if saves legitimately "
            "take longer",
            phase=phase,
            ranks=missing,
        )

    def _call(self, phase: str, fn: Any, *args: Any) -> Any:
        try:
            return fn(*args)
        except Exception as exc:  # store gone: rank 0 (the store's host) probably died
            self.timed_out = True
            self.missing = [0]
            raise DistributedError(
                f"the torch.distributed store failed in phase {phase!r} ({exc}); rank 0, "
                "which hosts it, may have died",
                phase=phase,
                ranks=[0],
            ) from exc

    def _forget(self, key: str) -> None:
        try:
            self.store.delete_key(key)
        except Exception as exc:  # not every Store supports deletion
            log.debug("could not delete store key %s: %s", key, exc)

    def _delete_previous(self) -> None:
        """Leader, once every rank posted this phase: nobody reads the earlier keys again."""
        old = self.leftover_keys() + self.cleanup
        self.cleanup = []
        for key in old:
            self._forget(key)


def raise_failed(
    values: list[dict[str, Any]], *, phase: str, step: int | None = None, hint: str = ""
) -> None:
    """Raise one :class:`DistributedError` naming every rank whose value is not ok."""
    failed = [r for r, v in enumerate(values) if not v.get("ok")]
    if failed:
        detail = "; ".join(f"rank {r}: {values[r].get('error', '?')}" for r in failed)
        raise DistributedError(
            f"{_what(step)} failed in phase {phase!r} on rank(s) {failed}: {detail}{hint}",
            phase=phase,
            ranks=failed,
        )


def _decode(raw: Any) -> dict[str, Any]:
    try:
        value = json.loads(bytes(raw).decode())
    except (ValueError, UnicodeDecodeError):
        return {"ok": False, "error": "unreadable status"}
    return value if isinstance(value, dict) else {"ok": False, "error": "malformed status"}


def _decode_result(raw: Any) -> dict[str, Any]:
    value = _decode(raw)
    if "values" in value or "missing" in value:
        return value
    return {"missing": [LEADER], "by": -1, "leader": "arrived but never decided"}


def _what(step: int | None) -> str:
    return "distributed operation" if step is None else f"checkpoint step {step}"
