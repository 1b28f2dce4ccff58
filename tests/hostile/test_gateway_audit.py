"""One gateway: every file event (open, rename, remove, mkdir, rmdir, link, chmod, listdir/scandir,
rmtree, ...) that flashckpt raises on a path under a root, a tier or a memory tier comes from
inside ``flashckpt.store.files.safeopen``. The scenarios (save, promotion, retention, gc, restore,
read-only restore, quarantine, verify, export, import and the CLI commands in-process) run under
``sys.addaudithook`` in a subprocess (a hook cannot be removed), see gateway_scenarios.py.

A new code path that opens, renames or deletes by path under a root fails here the day it is
written. (``os.stat`` raises no audit event: stat-only checks are not seen.)"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(600)
SCRIPT = Path(__file__).with_name("gateway_scenarios.py")


@pytest.fixture(scope="module")
def audit() -> dict:
    res = subprocess.run(
        [sys.executable, "-W", "ignore", str(SCRIPT)],
        capture_output=True,
        text=True,
        timeout=540,
        check=False,
    )
    assert res.returncode == 0, res.stderr[-4000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_scenarios_ran_to_the_end(audit):
    assert audit["error"] is None, audit["error"]


def test_every_scenario_touched_its_paths_through_the_gateway(audit):
    """Each scenario really did file work on the watched paths (the test is not vacuous)."""
    expected = {"save+promote+retention", "restore", "read-only restore", "gc", "cli verify",
                "cli ls", "cli gc", "cli import", "restore after damage"}  # fmt: skip
    seen = {name.split(" /")[0] for name in audit["through"]}
    assert expected <= seen, sorted(expected - seen)


def test_no_file_event_under_a_root_bypasses_the_gateway(audit):
    bypass = [v for v in audit["violations"] if v["scenario"] != "canary"]
    assert bypass == [], json.dumps(bypass, indent=1)


def test_the_hook_sees_a_raw_open_under_the_root(audit):
    canary = [v for v in audit["violations"] if v["scenario"] == "canary"]
    assert len(canary) == 1 and canary[0]["event"] == "open", audit["violations"]
