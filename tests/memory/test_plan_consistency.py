"""``flashckpt plan`` gives one answer per question: the verdict, the recompute section, the
largest batch and the fewest GPUs come from the same numbers, over a sweep of batches and
GPU budgets (a traced tiny HF model whose logits are a large share, as Qwen2.5's are)."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import pytest

from flashckpt.cli import plan
from flashckpt.memory import build_hf_model, hf_config
from flashckpt.memory.sizing import TracedSizer

CONFIG = {
    "model_type": "qwen2",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 4096,
    "tie_word_embeddings": True,
    "max_position_embeddings": 512,
}
SEQ = 128


def _run(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    parser = argparse.ArgumentParser(prog="flashckpt")
    plan.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["plan", *argv])
    assert args.func(args) == 0
    return capsys.readouterr().out


def _answers(out: str) -> dict[str, object]:
    verdict = re.search(r"peak \(phase-aware\)\s+\S+ \S+\s+(FITS|DOES NOT FIT)", out)
    assert verdict, out
    none = re.search(r"no recompute\s+(\d+|none)", out)
    full = re.search(r"full recompute\s+(\d+|none)", out)
    zero = {int(m[1]): int(m[2]) for m in re.finditer(r"ZeRO-(\d): +(\d+) GPU", out)}
    assert none and full, out
    return {
        "fits": verdict[1] == "FITS",
        "plan": re.search(r"recompute (\d+) of \d+ blocks", out) is not None,
        "cannot": "recompute cannot help" in out,
        "none": 0 if none[1] == "none" else int(none[1]),
        "full": 0 if full[1] == "none" else int(full[1]),
        "zero": zero,
    }


def test_plan_answers_agree_over_batches_and_budgets(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(CONFIG))
    sizer = TracedSizer(build_hf_model(hf_config(str(path))), seq_len=SEQ)
    at4 = {rec: sizer.estimate(batch_size=4, recompute=rec).peak_bytes for rec in (None, "full")}
    lo, hi = at4["full"], at4[None]
    # just above the all-blocks plan: logits are most of the shortfall (the old bug's regime)
    budgets = [lo - (hi - lo) // 4, lo + (hi - lo) // 10, hi + (hi - lo) // 4]
    seen = set()
    for budget in budgets:
        for batch in (2, 4, 6):
            argv = ["--model", str(path), "--gpu", "rtx4090", "--gpu-memory", str(budget)]
            out = _run(capsys, [*argv, "--batch", str(batch), "--seq", str(SEQ)])
            got = _answers(out)
            where = f"batch {batch}, budget {budget}:\n{out}"
            assert "no plan fits" not in out, where
            assert got["fits"] == (got["none"] >= batch), where
            if not got["fits"]:
                assert got["plan"] == (got["full"] >= batch), where
                assert got["cannot"] == (not got["plan"]), where
            zero = got["zero"]
            assert isinstance(zero, dict)
            assert (zero.get(0) == 1) == (got["fits"] or got["full"] >= batch), where
            assert all(zero[s] <= zero[0] for s in zero if 0 in zero), where
            seen.add((got["fits"], got["plan"]))
    assert seen >= {(True, False), (False, True), (False, False)}  # every answer was asked
