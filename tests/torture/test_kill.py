"""SIGKILL of real training processes during save, promotion, retention and gc (torture_kill)."""

from __future__ import annotations

from pathlib import Path

from torture_kill import ForkServer, KillSession


def test_kill(tmp_path: Path, kill_seed: int, fork_server: ForkServer) -> None:
    session = KillSession(base=tmp_path, seed=kill_seed, server=fork_server)
    session.run()
    for v in session.known:
        print(f"known bug (torture_known.py): [{v.invariant}] {v.detail}")
    print("\n".join(session.log))
