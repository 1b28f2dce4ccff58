"""Round trips: flashckpt -> DCP / safetensors / torch.save -> (no flashckpt) load -> import."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import flashckpt
from flashckpt.cli import main
from flashckpt.errors import ConfigError, UnsupportedStateError
from flashckpt.integrations import interop

# Runs with flashckpt made unimportable: proves the files need nothing of ours to load.
_NO_FLASHCKPT = """
import sys
sys.modules["flashckpt"] = None
import json, torch
fmt, path, out = sys.argv[1], sys.argv[2], sys.argv[3]
if fmt == "dcp":
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    md = dcp.FileSystemReader(path).read_metadata()
    sd = {k: torch.empty(m.size, dtype=m.properties.dtype)
          for k, m in md.state_dict_metadata.items() if isinstance(m, TensorStorageMetadata)}
    dcp.load(sd, checkpoint_id=path, no_dist=True)
elif fmt == "torch":
    sd = torch.load(path, weights_only=True)
else:
    from safetensors.torch import load_file
    sd = load_file(path)
try:
    import flashckpt  # noqa: F401
    raise SystemExit("flashckpt was importable")
except ImportError:
    pass
torch.save(sd, out)
"""


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3))


def _saved_root(tmp_path: Path) -> tuple[Path, torch.nn.Module, torch.optim.Optimizer]:
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(4, 6)).sum().backward()
    opt.step()
    root = tmp_path / "ckpt"
    with flashckpt.Checkpointer(root) as ck:
        ck.save(3, {"model": model, "optim": opt, "rng": flashckpt.RNG(), "epoch": 1})
    return root, model, opt


def _load_without_flashckpt(fmt: str, path: Path, tmp_path: Path) -> dict[str, torch.Tensor]:
    out = tmp_path / f"{fmt}-reloaded.pt"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run(
        [sys.executable, "-c", _NO_FLASHCKPT, fmt, str(path), str(out)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    loaded = torch.load(out, weights_only=True)
    assert isinstance(loaded, dict)
    return loaded


def _assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype, k
        assert torch.equal(a[k], b[k]), k


# DCP's nested layout has its own round trips in test_dcp_layout.py
@pytest.mark.parametrize("fmt", ["safetensors", "torch"])
def test_export_loads_without_flashckpt_and_imports_back(tmp_path: Path, fmt: str) -> None:
    root, model, _ = _saved_root(tmp_path)
    out = tmp_path / {"dcp": "dcp-out", "safetensors": "out.safetensors", "torch": "out.pt"}[fmt]
    assert main(["export", str(root), str(out), "--format", fmt]) == 0
    loaded = _load_without_flashckpt(fmt, out, tmp_path)
    expected = {f"model/{k}": v for k, v in model.state_dict().items()}
    assert {k: v for k, v in loaded.items() if k.startswith("model/")}.keys() == expected.keys()
    _assert_same({k: v for k, v in loaded.items() if k.startswith("model/")}, expected)
    assert any(k.startswith("optim/state/") for k in loaded)  # optimizer tensors travel too

    root2 = tmp_path / "imported"
    explicit = ["--format", "dcp"] if fmt == "dcp" else []  # never auto-detected (a pickle)
    assert main(["import", str(out), str(root2), "--step", "7", *explicit]) == 0
    fresh = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3))
    with flashckpt.Checkpointer(root2) as ck:
        assert ck.steps() == [7]
        assert ck.restore({"model": fresh}) == 7
    _assert_same(fresh.state_dict(), model.state_dict())


def test_prefix_export_loads_into_model(tmp_path: Path) -> None:
    root, model, _ = _saved_root(tmp_path)
    out = tmp_path / "model-dcp"
    assert interop.export_dcp(root, out, prefix="model") == 3
    sd = {k: torch.zeros_like(v) for k, v in model.state_dict().items()}
    import torch.distributed.checkpoint as dcp

    dcp.load(sd, checkpoint_id=str(out), no_dist=True)
    _assert_same(sd, model.state_dict())
    with pytest.raises(ConfigError, match="not empty"):
        interop.export_dcp(root, out, prefix="model")


def test_import_torch_save_bare_and_nested(tmp_path: Path) -> None:
    model = _model()
    bare = tmp_path / "bare.pt"
    torch.save(model.state_dict(), bare)
    state = interop.import_checkpoint(bare, tmp_path / "a", step=2)
    assert list(state) == ["model"]
    fresh = _model().apply(lambda m: [p.data.zero_() for p in m.parameters(recurse=False)])
    with flashckpt.Checkpointer(tmp_path / "a") as ck:
        ck.restore({"model": fresh})
    _assert_same(fresh.state_dict(), model.state_dict())

    nested = tmp_path / "nested.pt"
    torch.save({"weights": model.state_dict(), "epoch": 4, "lr": [0.1, 0.01]}, nested)
    interop.import_checkpoint(nested, tmp_path / "b", step=5)
    target: dict[str, object] = {"weights": {}, "epoch": None, "lr": None}
    with flashckpt.Checkpointer(tmp_path / "b") as ck:
        assert ck.restore(target) == 5
    assert target["epoch"] == 4 and target["lr"] == [0.1, 0.01]
    assert isinstance(target["weights"], dict)
    _assert_same(target["weights"], model.state_dict())


def test_import_safetensors_shard_directory(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    sd = _model().state_dict()
    keys = sorted(sd)
    shards = tmp_path / "shards"
    shards.mkdir()
    save_file({k: sd[k] for k in keys[:2]}, str(shards / "model-00001-of-00002.safetensors"))
    save_file({k: sd[k] for k in keys[2:]}, str(shards / "model-00002-of-00002.safetensors"))
    (shards / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {}}))
    state = interop.import_checkpoint(shards, tmp_path / "root", step=1)
    _assert_same(state["model"], sd)

    save_file({keys[0]: sd[keys[0]]}, str(shards / "dup.safetensors"))
    with pytest.raises(ConfigError, match="more than one shard"):
        interop.import_checkpoint(shards, tmp_path / "root2")


def test_import_refuses_unknown_sources(tmp_path: Path) -> None:
    junk = tmp_path / "notes.txt"
    junk.write_text("not a checkpoint")
    with pytest.raises(ConfigError, match="weights_only=True"):
        interop.import_checkpoint(junk, tmp_path / "r")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ConfigError, match=r"neither a DCP \.metadata"):
        interop.import_checkpoint(empty, tmp_path / "r")
    with pytest.raises(ConfigError, match="does not exist"):
        interop.import_checkpoint(tmp_path / "missing", tmp_path / "r")
    assert main(["import", str(junk), str(tmp_path / "r")]) == 2


def test_import_refuses_pickled_objects_and_bad_keys(tmp_path: Path) -> None:
    evil = tmp_path / "evil.pt"
    torch.save({"model": {"w": torch.ones(2)}, "cb": Path("x")}, evil)
    with pytest.raises(ConfigError, match="weights_only"):
        interop.import_checkpoint(evil, tmp_path / "r")
    slashed = tmp_path / "slashed.pt"
    torch.save({"a/b": 1, "c": torch.ones(1)}, slashed)
    with pytest.raises(UnsupportedStateError, match="'a/b'"):
        interop.import_checkpoint(slashed, tmp_path / "r")


def test_import_refuses_existing_step(tmp_path: Path) -> None:
    src = tmp_path / "m.pt"
    torch.save(_model().state_dict(), src)
    interop.import_checkpoint(src, tmp_path / "r", step=1)
    with pytest.raises(ConfigError, match="step 1 already exists"):
        interop.import_checkpoint(src, tmp_path / "r", step=1)
