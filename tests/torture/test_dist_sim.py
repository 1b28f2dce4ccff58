"""Seeded distributed torture: two gloo ranks on two nodes, slow peers, kills after the
manifest and at random instants, node loss (see torture_dist.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from torture_dist import DistSession

pytestmark = pytest.mark.dist


def test_dist_sim(tmp_path: Path, dist_seed: int) -> None:
    session = DistSession(base=tmp_path, seed=dist_seed)
    session.run()
    print("\n".join(session.log))
