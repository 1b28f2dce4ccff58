"""``Checkpointer.step(n)``: steps lost are measured when the loop does not call
``should_save`` every step; the HF and Lightning integrations tick every step."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

import flashckpt
from flashckpt.journal import read_events
from flashckpt.report.summary import load_events, summarize

MARKER = "locks/running.json"


def _marker_step(root: Path) -> Any:
    return json.loads((root / MARKER).read_text())["step"]


def test_steps_lost_counted_with_step_ticks_and_no_should_save(tmp_path: Path) -> None:
    """A loop that calls only step(n) and saves every 5 steps, killed with SIGKILL after
    step 12: the next run journals and reports the 2 steps it lost."""
    code = textwrap.dedent(
        f"""
        import os, signal, torch, flashckpt
        ck = flashckpt.Checkpointer({str(tmp_path)!r})
        w = torch.zeros(4)
        for step in range(1, 13):
            w += 1
            ck.step(step)
            if step % 5 == 0:
                ck.save(step, {{"w": w}})
        os.kill(os.getpid(), signal.SIGKILL)
        """
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=120)
    assert res.returncode == -signal.SIGKILL, res.stderr
    with flashckpt.Checkpointer(tmp_path) as ck:
        assert ck.restore({"w": torch.zeros(4)}) == 10
    events = read_events(tmp_path)
    (crash,) = [e for e in events if e["event"] == "crash_detected"]
    assert crash["last_trained_step"] == 12
    lost = [e for e in events if e["event"] == "steps_lost"]
    assert [(e["from_step"], e["to_step"], e["steps"]) for e in lost] == [(10, 12, 2)]
    assert summarize(load_events(tmp_path)).steps_lost == 2


def test_step_ticks_journal_the_step_time(tmp_path: Path) -> None:
    """Without should_save, step() still feeds the report's mean step time (lost seconds)."""
    with flashckpt.Checkpointer(tmp_path) as ck:
        for step in range(1, 52):
            ck.step(step)
    times = [e for e in read_events(tmp_path) if e["event"] == "step_time"]
    assert len(times) == 1 and times[0]["step"] == 50 and times[0]["seconds"] >= 0


def test_save_ticks_the_run_marker(tmp_path: Path) -> None:
    ck = flashckpt.Checkpointer(tmp_path)
    try:
        assert _marker_step(tmp_path) is None
        ck.save(7, {"w": torch.zeros(2)})
        assert _marker_step(tmp_path) == 7
        ck.step(9)
        assert _marker_step(tmp_path) == 9
    finally:
        ck.close()


def test_hf_callback_ticks_every_step(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    from flashckpt.integrations.hf import FlashCkptCallback

    cb = FlashCkptCallback(tmp_path, async_save=False)
    control = SimpleNamespace(should_save=False)
    seen = []
    try:
        for step in range(1, 4):
            cb.on_step_end(None, SimpleNamespace(global_step=step), control)
            seen.append(_marker_step(tmp_path))
    finally:
        cb.close()
    assert seen == [1, 2, 3]


def test_lightning_step_callback_ticks_the_store(tmp_path: Path) -> None:
    pytest.importorskip("lightning")
    from flashckpt.integrations.lightning import FlashCkptIO

    io = FlashCkptIO(tmp_path / "store", async_save=False)
    try:
        io.step_callback().on_train_batch_end(SimpleNamespace(global_step=3), None, None, None, 0)
        assert _marker_step(tmp_path / "store") == 3
    finally:
        io.teardown()


@pytest.mark.slow
def test_lightning_step_callback_ticks_every_batch(tmp_path: Path) -> None:
    L = pytest.importorskip("lightning")
    from flashckpt.integrations.lightning import FlashCkptIO

    class Tiny(L.LightningModule):  # type: ignore[misc,name-defined]
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(4, 1)

        def training_step(self, batch: Any, _idx: int) -> torch.Tensor:
            return self.lin(batch[0]).pow(2).mean()

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    seen: list[Any] = []

    class Probe(L.Callback):  # type: ignore[misc,name-defined]
        def on_train_batch_end(self, *args: Any, **kwargs: Any) -> None:
            seen.append(_marker_step(tmp_path / "store"))

    io = FlashCkptIO(tmp_path / "store", async_save=False)
    data = torch.utils.data.TensorDataset(torch.randn(12, 4))
    trainer = L.Trainer(
        default_root_dir=str(tmp_path),
        max_epochs=1,
        plugins=[io],
        callbacks=[io.step_callback(), Probe()],
        enable_checkpointing=False,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator="cpu",
    )
    trainer.fit(Tiny(), torch.utils.data.DataLoader(data, batch_size=3))
    io.teardown()
    assert seen == [1, 2, 3, 4]
