"""TensorBoard scalars for checkpoint metrics (needs ``tensorboard`` installed)."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from typing import Any

from flashckpt.errors import ConfigError
from flashckpt.report.summary import Event, RunSummary, save_records

log = logging.getLogger(__name__)

SUMMARY_TAGS = {
    "goodput": "flashckpt/goodput",
    "mean_blocking_s": "flashckpt/blocking_s_mean",
    "mean_durable_s": "flashckpt/durable_s_mean",
    "bytes_new": "flashckpt/bytes_new",
    "bytes_reused": "flashckpt/bytes_reused",
    "crashes": "flashckpt/crashes",
    "steps_lost": "flashckpt/steps_lost",
    "interval_s": "flashckpt/interval_s",
    "cost": "flashckpt/cost",
}


class TensorBoardSink:
    """Writes flashckpt scalars to a TensorBoard log directory.

    ``add_summary(summary, step=...)`` writes the run-level numbers at one step;
    ``add_saves(events)`` writes one point per save (blocking, time to durable, new/reused bytes,
    throughput) at the save's step. Raises ``ConfigError`` when tensorboard is not installed.
    """

    def __init__(self, log_dir: str | os.PathLike[str]) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:
            raise ConfigError(
                "TensorBoardSink needs the tensorboard package: pip install tensorboard"
            ) from exc
        self.log_dir = str(log_dir)
        self._writer: Any = SummaryWriter(log_dir=self.log_dir)

    def add_summary(self, summary: RunSummary, *, step: int) -> None:
        for attr, tag in SUMMARY_TAGS.items():
            value = getattr(summary, attr)
            if value is not None:
                self._writer.add_scalar(tag, float(value), global_step=step)

    def add_saves(self, events: Iterable[Event]) -> int:
        """One scalar per measured quantity per save; returns the number of saves written."""
        n = 0
        for r in save_records(events):
            if r.step is None or r.failed is not None:
                continue
            for tag, value in (
                ("flashckpt/save/blocking_s", r.blocking_s),
                ("flashckpt/save/durable_s", r.durable_s),
                ("flashckpt/save/new_bytes", r.new_bytes),
                ("flashckpt/save/reused_bytes", r.reused_bytes),
                ("flashckpt/save/throughput_Bps", r.throughput_Bps),
            ):
                if value is not None:
                    self._writer.add_scalar(tag, value, global_step=r.step)
            n += 1
        return n

    def flush(self) -> None:
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()

    def __enter__(self) -> TensorBoardSink:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
