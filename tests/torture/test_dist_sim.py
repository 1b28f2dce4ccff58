"""Seeded distributed torture: two gloo ranks on two nodes, slow peers, kills after the
manifest and at random instants, node loss (see torture_dist.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from torture_dist import DistSession, RunPlan, expected_digest
from torture_oracle import ViolationError

pytestmark = pytest.mark.dist  # (the oracle tests below start no process)


def test_dist_sim(tmp_path: Path, dist_seed: int) -> None:
    session = DistSession(base=tmp_path, seed=dist_seed)
    session.run()
    print("\n".join(session.log))


# -- the oracle itself, on made-up reports (no processes) ---------------------------------------


def _ev(rank: int, event: str, step: int | None = None, t: float = 0.0, **kw: object) -> dict:
    return {"rank": rank, "event": event, "step": step, "t": t, **kw}


def _restored(step: int | None, digest: str | None = None) -> list[dict]:
    if step is not None and digest is None:
        digest = expected_digest(0, step)
    return [_ev(k, "restored", step, digest=digest) for k in (0, 1)]


def _first_run(session: DistSession, *, second: str) -> None:
    """Run 0 saves step 0 (ok on both ranks), then step 1 with ``second``'s outcome on rank 0
    (rank 1 was killed: no report), 10 s later."""
    plan = RunPlan(
        run=0, saves=2, kill=None, kill_at=0, kill_rank=0, kill_delay_s=0.0, slow_rank=None
    )
    events = _restored(None)
    for k in (0, 1):
        events += [_ev(k, "saving", 0, 0.0), _ev(k, "ok", 0, 0.1), _ev(k, "saving", 1, 10.0)]
    if second == "ok":
        events += [_ev(0, "ok", 1, 10.1), _ev(1, "ok", 1, 10.1)]
    else:
        events.append(_ev(0, "error", 1, 14.0, type=second, msg=""))
    events += [_ev(0, "exit", code=0), _ev(1, "exit", code=-9)]
    session.check_restore(0, events)
    session.settle(0, plan, events)


def _violation(session: DistSession, events: list[dict]) -> str:
    with pytest.raises(ViolationError) as err:
        session.check_restore(1, events)
    return err.value.violation.invariant


def test_dist_oracle_calls_an_older_restore_a_lost_step(tmp_path: Path, own_counts: None) -> None:
    s = DistSession(base=tmp_path, seed=0)
    _first_run(s, second="ok")
    assert s.saved[0].safe and not s.saved[1].safe  # step 1: no later save, no close
    assert _violation(s, _restored(0)) == "durable_lost"


def test_dist_oracle_excuses_within_the_bound_only_after_a_node_loss(
    tmp_path: Path, own_counts: None
) -> None:
    s = DistSession(base=tmp_path, seed=0)
    _first_run(s, second="ok")
    for v in s.saved.values():  # what one_run does when node 1 is lost
        v.excused = v.status == "ok" and not v.safe
    s.check_restore(1, _restored(0))  # step 1 was not yet past the bound: may be lost
    assert 1 not in s.saved  # and the next run branched at 0


def test_dist_oracle_catches_a_restored_failed_step_and_other_bytes(
    tmp_path: Path, own_counts: None
) -> None:
    s = DistSession(base=tmp_path, seed=0)
    _first_run(s, second="DistributedError")
    assert s.saved[1].status == "failed"
    assert _violation(s, _restored(1)) == "failed_step_restored"
    assert _violation(s, _restored(0, expected_digest(7, 0))) == "restore_wrong_data"
    assert _violation(s, [_restored(0)[0], _restored(None)[1]]) == "dist_disagree"


def test_dist_oracle_lets_an_outcome_unknown_step_be_restored(
    tmp_path: Path, own_counts: None
) -> None:
    s = DistSession(base=tmp_path, seed=0)
    _first_run(s, second="OutcomeUnknownError")
    assert s.saved[1].status == "unknown"
    s.check_restore(1, _restored(1, expected_digest(0, 1)))
