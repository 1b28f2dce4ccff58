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
    "flashckpt.engine.runtime.checkpointer",
    "flashckpt.distributed",
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
    from flashckpt.engine.restore.readonly import restore
    from flashckpt.engine.runtime.checkpointer import Checkpointer

    assert flashckpt.Checkpointer is Checkpointer and flashckpt.restore is restore
    assert flashckpt.policy.__name__ == "flashckpt.policy"
    for name in flashckpt.__all__:
        assert getattr(flashckpt, name) is not None, name
    assert set(flashckpt.__all__) <= set(dir(flashckpt))


def test_unknown_attribute_is_an_attribute_error():
    import flashckpt

    with pytest.raises(AttributeError, match="no_such_name"):
        flashckpt.no_such_name  # noqa: B018


SAVE_RESTORE = textwrap.dedent(
    """
    import json, sys, torch, flashckpt
    model = torch.nn.Linear(8, 4)  # no optimizer step: in torch 2.13 it imports torch._dynamo,
    extra = {{"ema": torch.randn(4, 8), "epoch": 3}}  # which imports torch.distributed.tensor
    for async_save in (False, True):
        root = sys.argv[1] + f"/{{async_save}}"
        with flashckpt.Checkpointer(root, async_save=async_save) as ck:
            ck.save(1, {{"model": model, "extra": extra}})
        with flashckpt.Checkpointer(root) as ck:
            assert ck.restore({{"model": model, "extra": extra}}) == 1
    print(json.dumps(sorted(m for m in sys.modules if m.startswith("torch.distributed.tensor"))))
    """
)


def test_saving_and_restoring_plain_tensors_never_imports_dtensor(tmp_path) -> None:
    """Regression: capture asked "is this a DTensor?" by importing torch.distributed.tensor,
    1-1.5 s here, paid by the first save or restore of a process that had not loaded it (an
    async save of 1 MiB blocked 0.95 s; a restore at start-up, before the first optimizer
    step), although no tensor can be a DTensor before that module is loaded."""
    code = SAVE_RESTORE.format()
    out = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []
