"""Run reports from the journal: HTML page with SVG plots, terminal summary, Prometheus,
TensorBoard."""

from flashckpt.report.html import build_report, write_report
from flashckpt.report.prometheus import PrometheusExporter, exposition, write_prometheus_textfile
from flashckpt.report.summary import RunSummary, SaveRecord, load_events, save_records, summarize
from flashckpt.report.tensorboard import TensorBoardSink

__all__ = [
    "PrometheusExporter",
    "RunSummary",
    "SaveRecord",
    "TensorBoardSink",
    "build_report",
    "exposition",
    "load_events",
    "save_records",
    "summarize",
    "write_prometheus_textfile",
    "write_report",
]
