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
    if "--method" not in argv:
        args.method = "formula"  # fast; the traced CLI is tested on a tiny config below
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
    assert "formula estimate" in out
    assert "fewest" not in out


def test_plan_unknown_gpu_is_a_config_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ConfigError, match=r"known: .*h100"):
        _run(capsys, "--model", "gpt2", "--gpu", "tpu", "--batch", "1", "--seq", "8")


def test_plan_through_the_main_entry_point(capsys: pytest.CaptureFixture[str]) -> None:
    from flashckpt import cli

    assert "plan" in cli.COMMAND_MODULES
    argv = ["plan", "--model", "gpt2", "--gpu", "h100", "--batch", "1", "--seq", "8"]
    assert cli.main([*argv, "--method", "formula"]) == 0
    assert cli.main(["plan", "--model", "gpt2", "--gpu", "tpu", "--batch", "1", "--seq", "8"]) == 2
    assert "unknown GPU" in capsys.readouterr().err


def _gpt2_medium_rtx4090(capsys: pytest.CaptureFixture[str]) -> str:
    argv = ("--model", "gpt2-medium", "--gpu", "rtx4090", "--batch", "16", "--seq", "1024")
    code, out = _run(capsys, *argv)
    assert code == 0 and "DOES NOT FIT" in out and "peak with plan" in out
    return out


def test_plan_fewest_gpus_considers_the_recompute_plan(capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 15: "does not fit on up to 4096 GPUs" was printed under a plan that fits on one."""
    out = _gpt2_medium_rtx4090(capsys)
    assert "does not fit on up to" not in out
    assert re.search(r"ZeRO-0:\s+1 GPU\(s\).*recompute", out)
    found = re.search(r"plan above \(\d+\)\s+(\d+)", out)
    assert found and int(found.group(1)) >= 16  # the batch asked for fits with the plan


def test_plan_preallocation_uses_the_plan_that_fits(capsys: pytest.CaptureFixture[str]) -> None:
    out = _gpt2_medium_rtx4090(capsys)
    reserve = re.search(r"reserve ([\d.]+) GiB up front \(allocated peak \+ 5%, with the", out)
    with_plan = re.search(r"peak with plan: ([\d.]+) GiB", out)
    assert reserve and with_plan and float(reserve.group(1)) < float(with_plan.group(1)) < 24


def test_plan_fits_means_the_whole_step_fits_the_gpu(capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 15: a baseline was "(fits)" when its activations fit, not the whole step."""
    out = _gpt2_medium_rtx4090(capsys)
    rows = re.findall(r"baseline .* peak ([\d.]+) GiB \((fits|does not fit)\)", out)
    assert len(rows) == 2
    for peak, verdict in rows:
        assert (float(peak) <= 23.99) == (verdict == "fits")


def test_plan_options_reach_the_estimate(capsys: pytest.CaptureFixture[str]) -> None:
    base = ("--model", "llama-2-7b", "--gpu", "a100-80g", "--batch", "1", "--seq", "2048")
    _, plain = _run(capsys, *base)
    _, lora = _run(capsys, *base, "--trainable-fraction", "0.01", "--optimizer-offload")
    _, accum = _run(capsys, *base, "--grad-accum", "4", "--optimizer-impl", "fused")
    _, eight = _run(capsys, *base, "--optimizer", "adamw-8bit", "--dropout", "on")

    def part(out: str, key: str) -> str:
        found = re.search(rf"  {key}\s+(\S+ \S+)", out)
        assert found, key
        return found.group(1)

    assert part(plain, "optimizer_temp") != "0 B" and part(accum, "optimizer_temp") == "0 B"
    assert part(lora, "optimizer") == "0 B" and "x 4 micro-batches" in accum
    assert part(eight, "optimizer") != part(plain, "optimizer")


def test_plan_traces_a_hf_config(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    config = tmp_path / "config.json"
    config.write_text(
        json.dumps(
            {
                "model_type": "mixtral",
                "hidden_size": 64,
                "intermediate_size": 96,
                "num_hidden_layers": 2,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "num_local_experts": 4,
                "num_experts_per_tok": 2,
                "vocab_size": 97,
                "experts_implementation": "batched_mm",
            }
        )
    )
    argv = ("--model", str(config), "--gpu", "rtx4090", "--batch", "2", "--seq", "16")
    code, out = _run(capsys, *argv, "--method", "auto", "--world-size", "1")
    assert code == 0 and "traced: one real training step" in out and "FITS" in out
    import transformers

    want = sum(
        p.numel()
        for p in transformers.MixtralForCausalLM(
            transformers.MixtralConfig(**json.loads(config.read_text()))
        ).parameters()
    )
    assert f"{want / 1e9:.2f}B params" in out and "mixtral" in out
    with pytest.raises(ConfigError, match="mixture of experts"):
        _run(capsys, *argv, "--method", "formula")


def test_plan_without_gpu_sizes_a_cpu_run(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """Issue 31: `flashckpt plan` demanded --gpu even to size a CPU run."""
    import sys

    sys.path.insert(0, str(Path(__file__).parent))
    from hf_tiny import model as tiny
    from realstep import measured_peak

    config = tmp_path / "config.json"
    values = {"model_type": "llama", "vocab_size": 97, "hidden_size": 64}
    values |= {"intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4}
    values |= {"num_key_value_heads": 2, "max_position_embeddings": 256}
    config.write_text(json.dumps(values))
    argv = ("--model", str(config), "--batch", "2", "--seq", "128", "--method", "auto")
    code, out = _run(capsys, *argv)
    assert code == 0 and "CPU run (host memory)" in out and "FITS" in out
    assert "ZeRO-0:" not in out and "PYTORCH_CUDA_ALLOC_CONF" not in out
    assert re.search(r"workspace\s+0 B", out)
    peak = re.search(r"peak \(phase-aware\)\s+([\d.]+) MiB", out)
    real = measured_peak(tiny("llama"), batch=2, seq=128) / 2**20
    # a CPU run: no caching allocator, so no fragmentation margin on top of the live bytes
    assert peak and float(peak[1]) == pytest.approx(real, rel=0.02)
    code, out = _run(capsys, *argv, "--gpu-memory", "1MiB")
    assert "DOES NOT FIT" in out
    with pytest.raises(ConfigError, match="pass --gpu NAME"):
        _run(capsys, *argv[:-2], "--method", "formula")
