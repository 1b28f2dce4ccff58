"""``flashckpt.dist`` (the old name of ``flashckpt.distributed``) keeps working for one release:
the same objects, one DeprecationWarning naming the new import, and nothing else under it."""

from __future__ import annotations

import subprocess
import sys

CODE = """
import warnings
warnings.simplefilter("always")
with warnings.catch_warnings(record=True) as seen:
    from flashckpt.dist import init_process_group
    import flashckpt.dist as old
    count = old.restart_count
import flashckpt.distributed as new
assert init_process_group is new.init_process_group, "not the same function"
assert count is new.restart_count
msgs = [str(w.message) for w in seen if issubclass(w.category, DeprecationWarning)]
assert len(msgs) == 1, msgs
assert "flashckpt.distributed" in msgs[0], msgs
try:
    old.no_such_name
except AttributeError:
    pass
else:
    raise AssertionError("a missing name must raise AttributeError")
print("ok")
"""


def test_the_old_name_forwards_and_warns_once() -> None:
    out = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
