"""``import flashckpt`` stays light: the engine and its dependencies load on first use (PEP 562
in flashckpt/__init__.py), and the public names still resolve. Checked in a fresh interpreter
by what is in ``sys.modules``, never by timing."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

# what `import flashckpt` must not pull in (each is loaded by the first Checkpointer/restore)
LAZY = (
    "flashckpt.engine",
    "flashckpt.engine.checkpointer",
    "flashckpt.dist",
    "flashckpt.store",
    "flashckpt.state",
    "flashckpt.policy",
    "flashckpt.journal",
    "flashckpt.report",
    "flashckpt.memory",
    "flashckpt.integrations",
    "flashckpt.cli",
    "xxhash",
    "zstandard",
    "fsspec",
    "transformers",
    "prometheus_client",
)

PROBE = textwrap.dedent(
    """
    import json, sys
    import flashckpt
    print(json.dumps(sorted(m for m in {lazy!r} if m in sys.modules)))
    """
)


def test_import_flashckpt_loads_no_heavy_module():
    code = PROBE.format(lazy=LAZY)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout) == []  # none of LAZY after a bare `import flashckpt`


def test_public_names_resolve_lazily_to_their_definitions():
    import flashckpt
    from flashckpt.engine.checkpointer import Checkpointer
    from flashckpt.engine.readonly import restore

    assert flashckpt.Checkpointer is Checkpointer and flashckpt.restore is restore
    assert flashckpt.policy.__name__ == "flashckpt.policy"
    for name in flashckpt.__all__:
        assert getattr(flashckpt, name) is not None, name
    assert set(flashckpt.__all__) <= set(dir(flashckpt))


def test_unknown_attribute_is_an_attribute_error():
    import flashckpt

    with pytest.raises(AttributeError, match="no_such_name"):
        flashckpt.no_such_name  # noqa: B018
