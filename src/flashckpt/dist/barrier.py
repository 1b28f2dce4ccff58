"""A store-based barrier that carries errors (torchsnapshot's ``LinearBarrier`` idea).

Every rank posts one JSON status under ``<prefix>/<phase>/<rank>`` in the c10d Store and then
polls until the statuses of all ranks are there. Because every rank reads the same statuses, a
failure anywhere becomes the same :class:`~flashckpt.errors.DistributedError` on every rank,
naming the phase and the failing ranks. It uses only Store ``set``/``check``/``get``, never a
collective, so it may run on a background thread while training runs collectives.

A rank that never arrives (it died, or hangs) makes the others fail after ``timeout_s`` with a
``DistributedError`` naming the missing ranks; the first rank to time out posts an ``abort``
record so that a late rank does not proceed alone.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from flashckpt.errors import DistributedError

log = logging.getLogger(__name__)

_POLL_MIN_S = 0.002
_POLL_MAX_S = 0.05


@dataclass(kw_only=True)
class StoreBarrier:
    """Exchanges statuses between ``world_size`` ranks under a key ``prefix``.

    Contract, for each call of :meth:`exchange` (every rank calls with the same phases in the
    same order): 1. post this rank's value; 2. wait until every rank posted, an ``abort`` is
    posted, or ``timeout_s`` passes; 3. return the values by rank, or raise. Keys this rank
    posted for the previous phase are deleted once the current phase completes (by then every
    rank has read them).
    """

    store: Any
    rank: int
    world_size: int
    timeout_s: float
    prefix: str
    timed_out: bool = False  # set when a rank never arrived or the store failed
    _stale: list[str] = field(default_factory=list)

    def exchange(self, phase: str, value: dict[str, Any]) -> list[dict[str, Any]]:
        """Post ``value`` for ``phase`` and return every rank's value, in rank order."""
        base = f"{self.prefix}/{phase}"
        mine = f"{base}/{self.rank}"
        self._call(phase, self.store.set, mine, json.dumps(value).encode())
        got = self._collect(phase, base)
        self._drop_stale()
        self._stale.append(mine)
        return [got[r] for r in range(self.world_size)]

    def agree(
        self, phase: str, error: str | None, *, step: int | None = None, hint: str = ""
    ) -> None:
        """Barrier: raise the same :class:`DistributedError` everywhere if any rank failed."""
        values = self.exchange(phase, {"ok": error is None, "error": error or ""})
        failed = [r for r, v in enumerate(values) if not v.get("ok")]
        if failed:
            detail = "; ".join(f"rank {r}: {values[r].get('error', '?')}" for r in failed)
            raise DistributedError(
                f"{_what(step)} failed in phase {phase!r} on rank(s) {failed}: {detail}{hint}",
                phase=phase,
                ranks=failed,
            )

    def _collect(self, phase: str, base: str) -> dict[int, dict[str, Any]]:
        got: dict[int, dict[str, Any]] = {}
        deadline = time.monotonic() + self.timeout_s
        pause = _POLL_MIN_S
        abort = f"{base}/abort"
        while True:
            for r in range(self.world_size):
                key = f"{base}/{r}"
                if r not in got and self._call(phase, self.store.check, [key]):
                    got[r] = _decode(self._call(phase, self.store.get, key))
            if len(got) == self.world_size:
                return got
            if self._call(phase, self.store.check, [abort]):
                record = _decode(self._call(phase, self.store.get, abort))
                raise self._timeout(phase, [int(r) for r in record.get("missing", [])])
            if time.monotonic() > deadline:
                missing = [r for r in range(self.world_size) if r not in got]
                note = json.dumps({"rank": self.rank, "missing": missing}).encode()
                self._call(phase, self.store.set, abort, note)
                raise self._timeout(phase, missing)
            time.sleep(pause)
            pause = min(pause * 2, _POLL_MAX_S)

    def _timeout(self, phase: str, missing: list[int]) -> DistributedError:
        self.timed_out = True
        return DistributedError(
            f"timeout after {self.timeout_s:g}s in phase {phase!r}: rank(s) {missing} never "
            "arrived (crashed, hung or far behind); nothing was published by this phase. "
            "Raise dist_timeout_s if saves legitimately take longer",
            phase=phase,
            ranks=missing,
        )

    def _call(self, phase: str, fn: Any, *args: Any) -> Any:
        try:
            return fn(*args)
        except Exception as exc:  # store gone: rank 0 (the store's host) probably died
            self.timed_out = True
            raise DistributedError(
                f"the torch.distributed store failed in phase {phase!r} ({exc}); rank 0, "
                "which hosts it, may have died",
                phase=phase,
                ranks=[0],
            ) from exc

    def _drop_stale(self) -> None:
        for key in self._stale:
            try:
                self.store.delete_key(key)
            except Exception as exc:  # not every Store supports deletion
                log.debug("could not delete store key %s: %s", key, exc)
        self._stale.clear()


def _decode(raw: Any) -> dict[str, Any]:
    try:
        value = json.loads(bytes(raw).decode())
    except (ValueError, UnicodeDecodeError):
        return {"ok": False, "error": "unreadable status"}
    return value if isinstance(value, dict) else {"ok": False, "error": "malformed status"}


def _what(step: int | None) -> str:
    return "distributed operation" if step is None else f"checkpoint step {step}"
