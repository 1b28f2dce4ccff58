"""The store commands through ``flashckpt.cli.main``."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import flashckpt
from flashckpt.cli import main


@pytest.fixture
def root(tmp_path, make_state):
    state = make_state(width=64)
    with flashckpt.Checkpointer(tmp_path / "ck") as ckpt:
        ckpt.save(1, state)
        with torch.no_grad():
            state["model"].fc1.weight.add_(1)
        ckpt.save(2, state)
    return tmp_path / "ck"


def test_help_everywhere(capsys):
    # one real process (the entry point works), the subcommands in-process: each process
    # imports torch, which made this test take over a minute on a busy machine
    argv = [sys.executable, "-m", "flashckpt.cli", "--help"]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "usage: flashckpt" in out.stdout, out.stderr
    for cmd in (["ls"], ["inspect"], ["verify"], ["gc"], ["diff"], ["export"]):
        with pytest.raises(SystemExit) as exit_:
            main([*cmd, "--help"])
        assert exit_.value.code == 0, cmd
        assert f"usage: flashckpt {cmd[0]}" in capsys.readouterr().out, cmd


def test_python_m_flashckpt_runs_the_cli(root):
    """``python -m flashckpt`` is the CLI (issue 31: only ``python -m flashckpt.cli`` worked)."""
    argv = [sys.executable, "-m", "flashckpt", "ls", str(root)]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    steps = [x.split()[0] for x in out.stdout.splitlines() if x[:1].isdigit()]
    assert steps == ["1", "2"], out.stdout
    bad = subprocess.run(
        [sys.executable, "-m", "flashckpt", "ls", str(root / "missing")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 2 and "Traceback" not in bad.stderr, bad.stderr


def test_ls_and_inspect(root, capsys):
    assert main(["ls", str(root)]) == 0
    out = capsys.readouterr().out
    lines = [x for x in out.splitlines() if x[:1].isdigit()]
    assert [x.split()[0] for x in lines] == ["1", "2"]
    assert main(["inspect", str(root), "--step", "1"]) == 0
    out = capsys.readouterr().out
    assert "model/fc1.weight" in out and "float32" in out and "64x64" in out
    assert "sched" in out


def test_diff_names_changed_tensor(root, capsys):
    assert main(["diff", str(root), "1", "2"]) == 0
    out = capsys.readouterr().out
    assert "model/fc1.weight" in out
    assert "model/fc2.weight" not in out


def test_gc_and_not_a_root(root, tmp_path, capsys):
    (root / "chunks" / "ff").mkdir(exist_ok=True)
    (root / "chunks" / "ff" / ("f" * 32)).write_bytes(b"orphan")
    assert main(["gc", str(root)]) == 0
    assert "deleted 1 " in capsys.readouterr().out
    assert main(["ls", str(tmp_path / "nothing")]) == 2
    assert "not a flashckpt checkpoint root" in capsys.readouterr().err


@pytest.mark.parametrize("fmt", ["safetensors", "torch"])
def test_export_loads_without_flashckpt(root, tmp_path, fmt, make_state):
    out = tmp_path / f"model.{fmt}"
    argv = ["export", str(root), str(out), "--format", fmt, "--prefix", "model", "--step", "2"]
    assert main(argv) == 0
    code = (
        "import sys; sys.modules['flashckpt'] = None\n"
        "import torch\n"
        + (
            f"from safetensors.torch import load_file; sd = load_file({str(out)!r})\n"
            if fmt == "safetensors"
            else f"sd = torch.load({str(out)!r}, weights_only=True)\n"
        )
        + "print(sorted(sd)); print(float(sd['fc1.weight'].sum()))"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    target = make_state(width=64, trained=0)
    with flashckpt.Checkpointer(root) as ckpt:
        ckpt.restore({"model": target["model"]}, step=2, strict=False)
    assert "fc1.weight" in res.stdout
    assert abs(float(res.stdout.splitlines()[1]) - float(target["model"].fc1.weight.sum())) < 1e-3


def test_ls_survives_odd_stats(root, capsys):
    import json

    path = root / "steps" / "000000000002.json"
    doc = json.loads(path.read_text())
    doc["stats"] = {"new_bytes": "lots", "reused_bytes": [1]}
    path.write_text(json.dumps(doc))
    assert main(["ls", str(root)]) == 0
    assert "0 B" in capsys.readouterr().out
