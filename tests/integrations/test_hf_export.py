"""export --format hf: AutoModelForCausalLM.from_pretrained(DIR) loads it offline, in a process
without flashckpt (tiny GPT-2 with tied embeddings; tiny Llama sharded with an index file)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
import transformers

import flashckpt
from flashckpt.cli import main
from flashckpt.errors import ConfigError
from flashckpt.integrations.hf import FlashCkptCallback
from flashckpt.integrations.hf_export import export_hf

_LOAD = """
import sys
sys.modules["flashckpt"] = None
import torch
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], local_files_only=True).eval()
ids = torch.arange(12).reshape(2, 6) % 50
with torch.no_grad():
    logits = model(ids).logits
torch.save({"logits": logits, "sd": model.state_dict()}, sys.argv[2])
"""

IDS = torch.arange(12).reshape(2, 6) % 50


def load_without_flashckpt(path: Path, tmp: Path) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    out = tmp / "loaded.pt"
    proc = subprocess.run(
        [sys.executable, "-c", _LOAD, str(path), str(out)],
        capture_output=True,
        text=True,
        env=env,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = torch.load(out, weights_only=True)
    assert isinstance(got, dict)
    return got


def trained(model: Any) -> Any:
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    model(IDS, labels=IDS).loss.backward()
    opt.step()
    return model.eval()


def assert_loads_as(model: Any, got: dict[str, Any]) -> None:
    with torch.no_grad():
        assert torch.equal(got["logits"], model(IDS).logits)
    for k, v in model.state_dict().items():
        assert torch.equal(got["sd"][k], v), k


def test_gpt2_saved_by_the_trainer_callback_loads_with_from_pretrained(tmp_path: Path) -> None:
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=50, n_positions=16)
    model = trained(transformers.GPT2LMHeadModel(cfg))
    cb = FlashCkptCallback(tmp_path / "ckpt", async_save=False)
    control = transformers.TrainerControl(should_save=True)
    cb.on_step_end(None, transformers.TrainerState(global_step=4), control, model=model)
    cb.close()
    out = tmp_path / "hf"
    assert main(["export", str(tmp_path / "ckpt"), str(out), "--format", "hf"]) == 0
    names = sorted(p.name for p in out.iterdir())
    assert names == ["config.json", "generation_config.json", "model.safetensors"]
    assert json.loads((out / "config.json").read_text())["model_type"] == "gpt2"
    assert_loads_as(model, load_without_flashckpt(out, tmp_path))


def tiny_gpt2() -> Any:
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=50, n_positions=16)
    return trained(transformers.GPT2LMHeadModel(cfg))


def test_plain_checkpointer_saves_the_config_and_exports_with_no_flags(tmp_path: Path) -> None:
    """Issue 31: ``{"model": hf_model}`` saved by a plain Checkpointer, then ``export --format
    hf`` with no flags, wrote no config.json and from_pretrained failed ("Unrecognized model")."""
    model = tiny_gpt2()
    model.generation_config.max_new_tokens = 7  # the generation config travels too
    root = tmp_path / "ckpt"
    with flashckpt.Checkpointer(root) as ck:
        ck.save(3, {"model": model, "optim": torch.optim.SGD(model.parameters(), lr=0.1)})
    doc = json.loads(next((root / "steps").glob("*.json")).read_bytes())  # plain JSON, no pickle
    assert doc["meta"]["model"]["hf_config"]["model_type"] == "gpt2"
    assert set(doc["meta"]) == {"model"}  # the optimizer is no transformers model
    out = tmp_path / "hf"
    argv = [sys.executable, "-m", "flashckpt", "export", str(root), str(out), "--format", "hf"]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads((out / "generation_config.json").read_text())["max_new_tokens"] == 7
    assert json.loads((out / "config.json").read_text())["n_embd"] == 32
    assert_loads_as(model, load_without_flashckpt(out, tmp_path))
    # a restore ignores the metadata: the model loads back as it was saved
    fresh = transformers.GPT2LMHeadModel(model.config)
    with flashckpt.Checkpointer(root) as ck:
        assert ck.restore({"model": fresh}, strict=False) == 3
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in fresh.state_dict().items())


def test_no_config_anywhere_is_one_line_and_writes_nothing(tmp_path: Path, capsys) -> None:
    torch.manual_seed(0)
    root = tmp_path / "ckpt"
    with flashckpt.Checkpointer(root) as ck:
        ck.save(1, {"model": torch.nn.Linear(4, 4)})  # not a transformers model: no config
    out = tmp_path / "hf"
    assert main(["export", str(root), str(out), "--format", "hf"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "no model config" in err and "--config" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no out, no temp directory


def test_a_failed_write_leaves_no_half_directory(tmp_path: Path, monkeypatch) -> None:
    import safetensors.torch

    model = tiny_gpt2()
    root = tmp_path / "ckpt"
    with flashckpt.Checkpointer(root) as ck:
        ck.save(1, {"model": model})
    calls = []

    def failing(tensors: Any, path: str, metadata: Any = None) -> None:
        calls.append(path)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        Path(path).write_bytes(b"x")

    monkeypatch.setattr(safetensors.torch, "save_file", failing)
    out = tmp_path / "hf"
    with pytest.raises(OSError):
        export_hf(root, out, max_shard_size="20KiB")
    assert len(calls) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_older_steps_with_an_hf_config_entry_still_export(tmp_path: Path) -> None:
    model = tiny_gpt2()
    root = tmp_path / "ckpt"
    config = json.loads(model.config.to_json_string(use_diff=False))
    with flashckpt.Checkpointer(root) as ck:  # the state the callback saved before issue 31
        ck.save(1, {"model": dict(model.state_dict()), "hf_config": config})
    assert json.loads(next((root / "steps").glob("*.json")).read_bytes()).get("meta") is None
    out = tmp_path / "hf"
    assert export_hf(root, out) == 1
    assert_loads_as(model, load_without_flashckpt(out, tmp_path))


def test_llama_sharded_above_the_size_limit_with_an_index(tmp_path: Path) -> None:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=50,
        max_position_embeddings=32,
    )
    model = trained(transformers.LlamaForCausalLM(cfg))
    root = tmp_path / "ckpt"
    with flashckpt.Checkpointer(root) as ck:
        ck.save(2, {"weights": model, "rng": flashckpt.RNG()})  # no config saved
    out = tmp_path / "hf"
    with pytest.raises(ConfigError, match="no model entry 'model'"):
        export_hf(root, out)
    cfg_dir = tmp_path / "cfg"
    cfg.save_pretrained(cfg_dir)  # the user passes the config
    assert export_hf(root, out, prefix="weights", config=cfg_dir, max_shard_size="20KiB") == 2
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(shards) > 1 and set(index["weight_map"].values()) == set(shards)
    assert sorted(index["weight_map"]) == sorted(model.state_dict())
    assert_loads_as(model, load_without_flashckpt(out, tmp_path))
