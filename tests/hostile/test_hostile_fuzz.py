"""Property-based fuzzing of everything flashckpt parses from disk: manifests, tiers.json,
journal lines, safetensors files and DCP metadata. The property is always the same: a clean
FlashCkptError (or a skipped item), never another exception, never a hang."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import flashckpt
from flashckpt.engine.tiers.config import read_config
from flashckpt.integrations import interop
from flashckpt.journal import iter_events, parse_line
from flashckpt.report.summary import summarize
from flashckpt.store.format.parse import parse_manifest

pytestmark = pytest.mark.timeout(120)
FUZZ = settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=6), children, max_size=4)
    ),
    max_leaves=20,
)


def _valid_manifest(tmp: Path) -> dict:
    with flashckpt.Checkpointer(tmp) as ckpt:
        ckpt.save(1, {"w": torch.arange(8.0), "t": {"lr": 0.1, "x": (1, [2])}})
    return json.loads((tmp / "steps" / "000000000001.json").read_text())


def _paths(doc, prefix=()):
    """Every (container, key) location in a JSON document."""
    if isinstance(doc, dict):
        for k, v in doc.items():
            yield doc, k
            yield from _paths(v)
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            yield doc, i
            yield from _paths(v)


@pytest.fixture(scope="module")
def manifest_doc(tmp_path_factory) -> dict:
    return _valid_manifest(tmp_path_factory.mktemp("fuzz-manifest"))


@FUZZ
@given(data=st.data())
def test_fuzzed_manifest_parses_or_raises_manifest_error(manifest_doc, data):
    doc = json.loads(json.dumps(manifest_doc))
    locations = list(_paths(doc))
    for _ in range(data.draw(st.integers(1, 3))):
        container, key = data.draw(st.sampled_from(locations))
        container[key] = data.draw(json_values)
        locations = list(_paths(doc))
    try:
        m = parse_manifest(json.dumps(doc).encode())
    except flashckpt.ManifestError:
        return
    for e in m.tensors.values():  # accepted: every tensor is tiled exactly
        assert sum(s.numel for s in e.shards) == e.nbytes // e.itemsize


@FUZZ
@given(raw=st.binary(max_size=200))
def test_random_bytes_are_never_a_manifest_crash(raw):
    with pytest.raises(flashckpt.ManifestError):
        parse_manifest(raw)


@FUZZ
@given(doc=json_values)
def test_fuzzed_tiers_json_is_read_or_ignored(tmp_path, doc):
    (tmp_path / "tiers.json").write_text(json.dumps({"version": 1, "tiers": doc}))
    cfg = read_config(tmp_path)
    assert all(isinstance(k, str) and isinstance(v, str) for k, v in cfg.items())


@FUZZ
@given(lines=st.lists(json_values | st.binary(max_size=40), max_size=6))
def test_fuzzed_journal_lines_are_events_or_skipped(tmp_path, lines):
    with open(tmp_path / "journal.jsonl", "wb") as f:
        for line in lines:
            if isinstance(line, bytes):
                f.write(line.replace(b"\n", b" ") + b"\n")
                continue
            f.write(json.dumps(line).encode() + b"\n")
            for key in ("step", "t", "blocking_s", "tier", "rank", "error"):
                record = {"event": "durable", "step": 1, "t": 1.0, key: line}
                f.write(json.dumps(record).encode() + b"\n")
    events = list(iter_events(tmp_path))
    assert all(isinstance(e["event"], str) for e in events)
    summarize(events)  # the report's numbers survive whatever the fields hold


@FUZZ
@given(event=json_values, extra=st.dictionaries(st.text(max_size=6), json_values, max_size=4))
def test_parse_line_accepts_only_string_events(event, extra):
    got = parse_line(json.dumps({**extra, "event": event, "t": 1.0}).encode())
    assert (got is not None) == isinstance(event, str)


@FUZZ
@given(raw=st.binary(max_size=300))
def test_fuzzed_safetensors_file_is_a_config_error(tmp_path, raw):
    (tmp_path / "x.safetensors").write_bytes(raw)
    try:
        interop.load_safetensors(tmp_path / "x.safetensors")
    except flashckpt.ConfigError:
        pass


@pytest.fixture(scope="module")
def dcp_metadata(tmp_path_factory) -> bytes:
    src = tmp_path_factory.mktemp("fuzz-dcp") / "dcp"
    interop.write_dcp({"w": torch.arange(4.0), "b": torch.ones(2, dtype=torch.int64)}, src)
    return (src / ".metadata").read_bytes()


@FUZZ
@given(data=st.data())
def test_fuzzed_dcp_metadata_is_a_config_error(tmp_path, dcp_metadata, data):
    src = tmp_path / "dcp"
    src.mkdir(exist_ok=True)
    raw = bytearray(dcp_metadata)
    for _ in range(data.draw(st.integers(1, 4))):
        raw[data.draw(st.integers(0, len(raw) - 1))] = data.draw(st.integers(0, 255))
    (src / ".metadata").write_bytes(bytes(raw))
    try:
        interop.load_dcp(src)
    except flashckpt.ConfigError:
        pass
