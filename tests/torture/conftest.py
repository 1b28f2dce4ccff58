"""Budgets and seeds of the torture harness, and the counts printed at the end.

``make test`` runs a fixed slice; ``make torture`` sets bigger sizes. Documented test overrides:

* ``FLASHCKPT_TORTURE_OPS``: simulated operations in all (split into trials of 40 ops, one seed
  per trial; default 240);
* ``FLASHCKPT_TORTURE_KILLS``: SIGKILLs of real processes in all (default 10);
* ``FLASHCKPT_TORTURE_DIST_RUNS``: runs of the 2-rank distributed torture in all (split into
  sessions of 4 runs, one seed per session; default 4);
* ``FLASHCKPT_TORTURE_SEED``: run only this seed (the reproduction command a failure prints);
* ``FLASHCKPT_TORTURE_STRICT=1``: fail on the bugs listed in ``torture_known.py`` too.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from torture_dist import RUNS_PER_SESSION
from torture_faults import STATS
from torture_kill import KILLS_PER_SESSION, ForkServer
from torture_known import HITS
from torture_sim import OPS_PER_TRIAL


def _int(name: str, default: int) -> int:
    value = os.environ.get(name, "")
    return int(value) if value.strip() else default


def seeds(total: int, per: int) -> list[int]:
    one = os.environ.get("FLASHCKPT_TORTURE_SEED", "").strip()
    if one:
        return [int(one)]
    return list(range(max(1, -(-total // per))))


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "sim_seed" in metafunc.fixturenames:
        ss = seeds(_int("FLASHCKPT_TORTURE_OPS", 240), OPS_PER_TRIAL)
        metafunc.parametrize("sim_seed", ss, ids=[f"sim-{s}" for s in ss])
    if "kill_seed" in metafunc.fixturenames:
        ss = seeds(_int("FLASHCKPT_TORTURE_KILLS", 10), KILLS_PER_SESSION)
        metafunc.parametrize("kill_seed", ss, ids=[f"kill-{s}" for s in ss])
    if "dist_seed" in metafunc.fixturenames:
        ss = seeds(_int("FLASHCKPT_TORTURE_DIST_RUNS", 4), RUNS_PER_SESSION)
        metafunc.parametrize("dist_seed", ss, ids=[f"dist-{s}" for s in ss])


@pytest.fixture(scope="session")
def fork_server() -> Iterator[ForkServer]:
    server = ForkServer()
    try:
        yield server
    finally:
        server.close()


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not STATS:
        return
    tr = terminalreporter
    tr.section("flashckpt torture")
    faults = {k[6:]: v for k, v in sorted(STATS.items()) if k.startswith("fault.")}
    checks = sum(v for k, v in STATS.items() if k == "checks" or k.startswith("checks."))
    tr.write_line(
        f"ops {STATS['ops']}  kills {STATS['kills']}  checks {checks}  "
        f"faults injected {sum(faults.values())}"
    )
    tr.write_line("faults by kind: " + ", ".join(f"{k}={v}" for k, v in faults.items()))
    rest = {k: v for k, v in sorted(STATS.items()) if not k.startswith(("fault.", "violation."))}
    tr.write_line("counts: " + ", ".join(f"{k}={v}" for k, v in rest.items()))
    hit = {k[10:]: v for k, v in sorted(STATS.items()) if k.startswith("violation.")}
    if hit:
        tr.write_line(
            "invariants violated (known bugs are in torture_known.py): "
            + ", ".join(f"{k}={v}" for k, v in hit.items())
        )
    for line in HITS:
        tr.write_line("known bug: " + line)


@pytest.fixture
def own_counts() -> Iterator[None]:
    """Violations provoked here on purpose stay out of the session's torture counts."""
    stats, hits = STATS.copy(), list(HITS)
    yield
    STATS.clear()
    STATS.update(stats)
    HITS[:] = hits
