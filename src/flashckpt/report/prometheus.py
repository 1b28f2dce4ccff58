"""Prometheus metrics: a textfile for node-exporter's textfile collector, or an HTTP endpoint.

The textfile needs nothing beyond the standard library. The HTTP endpoint uses
``prometheus_client`` (``pip install 'flashckpt[metrics]'``), listens on 127.0.0.1 unless told
otherwise, and reads the journal incrementally: each scrape parses only the lines appended since
the last one (:class:`~flashckpt.journal.JournalTail`) and folds only those into the summary
(:class:`~flashckpt.report.summary.JournalFold`); the journal already there is read when the
server starts, before the first scrape.
"""

from __future__ import annotations

import logging
import os
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from flashckpt.errors import ConfigError
from flashckpt.journal import JournalTail
from flashckpt.report.summary import Event, JournalFold, RunSummary, load_events, summarize

log = logging.getLogger(__name__)

# (metric name, RunSummary field, type, help)
METRICS: tuple[tuple[str, str, str, str], ...] = (
    ("flashckpt_saves_total", "saves", "counter", "Checkpoints saved"),
    ("flashckpt_saves_failed_total", "saves_failed", "counter", "Checkpoint saves that failed"),
    (
        "flashckpt_save_blocking_seconds_mean",
        "mean_blocking_s",
        "gauge",
        "Mean seconds training was blocked per save",
    ),
    (
        "flashckpt_save_blocking_seconds_max",
        "max_blocking_s",
        "gauge",
        "Longest training stall from one save, seconds",
    ),
    (
        "flashckpt_save_blocking_seconds_total",
        "blocking_s",
        "counter",
        "Seconds training was blocked by saves",
    ),
    (
        "flashckpt_time_to_durable_seconds_mean",
        "mean_durable_s",
        "gauge",
        "Mean seconds from a save call until durable in the slowest tier",
    ),
    ("flashckpt_bytes_new_total", "bytes_new", "counter", "Bytes written by saves"),
    (
        "flashckpt_bytes_reused_total",
        "bytes_reused",
        "counter",
        "Bytes saves reused from earlier checkpoints",
    ),
    (
        "flashckpt_throughput_bytes_per_second_mean",
        "mean_throughput_Bps",
        "gauge",
        "Mean checkpoint write throughput",
    ),
    ("flashckpt_restores_total", "restores", "counter", "Restores"),
    ("flashckpt_crashes_total", "crashes", "counter", "Crashes detected on restart"),
    (
        "flashckpt_scrub_damage_total",
        "scrub_damage",
        "counter",
        "Committed chunks the idle scrub found damaged (quarantined; the next save rewrites)",
    ),
    (
        "flashckpt_abandoned_copies_total",
        "abandoned_copies",
        "counter",
        "Checkpoint copies on an abandoned branch (lineage), skipped by restore",
    ),
    (
        "flashckpt_scrubbed_bytes_total",
        "scrubbed_bytes",
        "counter",
        "Bytes at rest the idle scrub read and verified",
    ),
    ("flashckpt_steps_lost_total", "steps_lost", "counter", "Training steps redone after crashes"),
    ("flashckpt_restarts_timed_total", "restarts_timed", "counter", "Restarts timed after crashes"),
    (
        "flashckpt_restart_seconds_last",
        "last_restart_s",
        "gauge",
        "Seconds from the kill to the first resumed step, last restart",
    ),
    (
        "flashckpt_restart_seconds_mean",
        "mean_restart_s",
        "gauge",
        "Mean seconds from a kill to the first resumed step",
    ),
    (
        "flashckpt_restart_seconds_max",
        "max_restart_s",
        "gauge",
        "Longest restart, kill to first resumed step, seconds",
    ),
    (
        "flashckpt_takeovers_total",
        "takeovers",
        "counter",
        "Restarts a warm standby took over (flashckpt run --standby 1)",
    ),
    (
        "flashckpt_takeover_seconds_mean",
        "mean_takeover_s",
        "gauge",
        "Mean seconds from a kill to the first step resumed by a warm standby",
    ),
    (
        "flashckpt_cold_restart_seconds_mean",
        "mean_cold_restart_s",
        "gauge",
        "Mean seconds from a kill to the first step resumed by a new process",
    ),
    ("flashckpt_last_step", "last_step", "gauge", "Newest step in the journal"),
    ("flashckpt_last_durable_step", "last_durable_step", "gauge", "Newest durable checkpoint"),
    ("flashckpt_interval_seconds", "interval_s", "gauge", "Chosen checkpoint interval"),
    (
        "flashckpt_governor_background_cost_seconds",
        "governor_background_cost_s",
        "gauge",
        "What a background save cost the loop lately (the governor's measure)",
    ),
    (
        "flashckpt_governor_foreground_cost_seconds",
        "governor_foreground_cost_s",
        "gauge",
        "What a foreground save cost the loop lately (the governor's budget)",
    ),
    ("flashckpt_wall_seconds", "wall_s", "counter", "Wall seconds covered by the journal"),
    ("flashckpt_goodput_ratio", "goodput", "gauge", "Useful training time / wall time"),
    ("flashckpt_cost_total", "cost", "counter", "Run cost (wall hours x GPUs x price)"),
    ("flashckpt_wasted_cost_total", "wasted_cost", "counter", "Cost not spent on useful training"),
)


# labelled: one sample per restart part (down, start, restore, first_step)
PARTS_METRIC = "flashckpt_restart_part_seconds"
PARTS_HELP = "Seconds of one part of a restart (label part: down, start, restore, first_step)"


def _part_samples(s: RunSummary) -> Iterator[tuple[str, str, float]]:
    """(stat, part, seconds): ``_last`` and ``_mean`` gauges of each part."""
    for stat, parts in (("last", s.restart_parts_last), ("mean", s.restart_parts_mean)):
        for part, value in parts.items():
            yield stat, part, float(value)


def _summary(summary_or_events: RunSummary | Iterable[Event] | str | Path) -> RunSummary:
    if isinstance(summary_or_events, RunSummary):
        return summary_or_events
    return summarize(load_events(summary_or_events))


def _samples(s: RunSummary) -> Iterator[tuple[str, str, str, float]]:
    for name, attr, kind, help_text in METRICS:
        value = getattr(s, attr)
        if value is not None:
            yield name, kind, help_text, float(value)


def exposition(summary_or_events: RunSummary | Iterable[Event] | str | Path) -> str:
    """Prometheus text exposition format (version 0.0.4) for a summary, events or a root."""
    lines = []
    summary = _summary(summary_or_events)
    for name, kind, help_text, value in _samples(summary):
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", f"{name} {value!r}"]
    seen: set[str] = set()
    for stat, part, value in _part_samples(summary):
        name = f"{PARTS_METRIC}_{stat}"
        if name not in seen:
            seen.add(name)
            lines += [f"# HELP {name} {PARTS_HELP} ({stat})", f"# TYPE {name} gauge"]
        lines.append(f'{name}{{part="{part}"}} {value!r}')
    return "\n".join(lines) + "\n"


def write_prometheus_textfile(
    path: str | os.PathLike[str], summary_or_events: RunSummary | Iterable[Event] | str | Path
) -> Path:
    """Atomically (write + rename) write the metrics to ``path``, e.g. for node-exporter's
    ``--collector.textfile.directory`` (the name must end in ``.prom``)."""
    out = Path(path)
    if out.suffix != ".prom":
        raise ConfigError(f"path must end in .prom (node-exporter reads only those), got {out}")
    text = exposition(summary_or_events)
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=f".{out.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, out)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return out


class PrometheusExporter:
    """Serve the metrics of checkpoint ``root`` over HTTP (``prometheus_client``'s server).

    ``start()`` binds ``addr:port`` (default 127.0.0.1: only this host; pass ``addr="0.0.0.0"``
    to serve every interface; ``port=0`` picks a free one, see ``.port``) in a daemon thread;
    each scrape reads what the journal gained since the last. ``close()`` stops the server.
    """

    def __init__(self, root: str | os.PathLike[str], *, port: int = 9464, addr: str = "127.0.0.1"):
        try:
            import prometheus_client  # noqa: F401
        except ImportError as exc:
            raise ConfigError(
                "PrometheusExporter needs prometheus_client; install the extra "
                "'flashckpt[metrics]' (or use write_prometheus_textfile, which needs nothing)"
            ) from exc
        if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
            raise ConfigError(f"port must be an int in 0..65535, got {port!r}")
        self.root, self.addr, self.port = Path(root), addr, port
        self._server: Any = None
        self.tail = JournalTail(self.root)
        self.fold = JournalFold()
        self._summary: RunSummary | None = None

    def summary(self) -> RunSummary:
        """The run summary as of now: the journal's new lines parsed and folded in (a
        replaced or truncated journal is folded again from its start)."""
        resets = self.tail.resets
        new = self.tail.poll()
        if self.tail.resets != resets:
            self.fold = JournalFold()
        if new or self._summary is None or self.tail.resets != resets:
            self.fold.extend(self.tail.events[len(self.fold.events) :])
            self._summary = self.fold.summary()
        return self._summary

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        summary = self.summary()
        for name, kind, help_text, value in _samples(summary):
            if kind == "counter":
                yield CounterMetricFamily(name.removesuffix("_total"), help_text, value=value)
            else:
                yield GaugeMetricFamily(name, help_text, value=value)
        families: dict[str, Any] = {}
        for stat, part, value in _part_samples(summary):
            name = f"{PARTS_METRIC}_{stat}"
            if name not in families:
                families[name] = GaugeMetricFamily(name, f"{PARTS_HELP} ({stat})", labels=["part"])
            families[name].add_metric([part], value)
        yield from families.values()

    def start(self) -> PrometheusExporter:
        from prometheus_client import CollectorRegistry, start_http_server

        self.summary()  # read the journal already there now, not in the first scrape
        registry = CollectorRegistry()
        registry.register(self)  # type: ignore[arg-type]
        server, _thread = start_http_server(self.port, addr=self.addr, registry=registry)
        self._server = server
        self.port = int(server.server_address[1])
        log.info("serving flashckpt metrics on http://%s:%d/metrics", self.addr, self.port)
        return self

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def __enter__(self) -> PrometheusExporter:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
