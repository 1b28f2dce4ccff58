from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import pytest

from flashckpt.cli import plan
from flashckpt.errors import ConfigError


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    parser = argparse.ArgumentParser(prog="flashckpt")
    sub = parser.add_subparsers(dest="command")
    plan.register(sub)
    args = parser.parse_args(["plan", *argv])
    code = args.func(args)
    return code, capsys.readouterr().out


def test_plan_fits(capsys: pytest.CaptureFixture[str]) -> None:
    code, out = _run(capsys, "--model", "gpt2", "--gpu", "h100", "--batch", "8", "--seq", "1024")
    assert code == 0
    assert "FITS" in out and "DOES NOT FIT" not in out
    for key in ("params", "activations", "logits", "fragmentation_margin"):
        assert key in out
    assert "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" in out
    assert "ZeRO-3:" in out  # no --world-size: the renter's question is answered


def test_plan_needs_recompute_and_prices(capsys: pytest.CaptureFixture[str]) -> None:
    code, out = _run(
        capsys,
        "--model",
        "gpt2-medium",
        "--gpu",
        "rtx4090",
        "--batch",
        "16",
        "--seq",
        "1024",
        "--gpu-hour-price",
        "0.5",
    )
    assert code == 0
    assert "DOES NOT FIT" in out
    found = re.search(r"recompute (\d+) of 24 blocks", out)
    assert found and 0 < int(found.group(1)) < 24
    assert "peak with plan" in out and "baseline every-2" in out
    assert "$0.50/GPU-h" in out


def test_plan_with_world_size_and_hf_config(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    config = tmp_path / "config.json"
    config.write_text(
        json.dumps(
            {
                "model_type": "llama",
                "hidden_size": 4096,
                "intermediate_size": 11008,
                "num_hidden_layers": 32,
                "num_attention_heads": 32,
                "vocab_size": 32000,
                "rms_norm_eps": 1e-5,
                "hidden_act": "silu",
                "tie_word_embeddings": False,
            }
        )
    )
    code, out = _run(
        capsys,
        "--model",
        str(config),
        "--gpu",
        "a100-80g",
        "--batch",
        "1",
        "--seq",
        "4096",
        "--zero",
        "3",
        "--world-size",
        "8",
    )
    assert code == 0 and "6.74B params" in out and "ZeRO-3, 8 GPU(s)" in out
    assert "fewest" not in out


def test_plan_unknown_gpu_is_a_config_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ConfigError, match=r"known: .*h100"):
        _run(capsys, "--model", "gpt2", "--gpu", "tpu", "--batch", "1", "--seq", "8")


def test_plan_through_the_main_entry_point(capsys: pytest.CaptureFixture[str]) -> None:
    from flashckpt import cli

    assert "plan" in cli.COMMAND_MODULES
    assert cli.main(["plan", "--model", "gpt2", "--gpu", "h100", "--batch", "1", "--seq", "8"]) == 0
    assert cli.main(["plan", "--model", "gpt2", "--gpu", "tpu", "--batch", "1", "--seq", "8"]) == 2
    assert "unknown GPU" in capsys.readouterr().err
