"""Step identity by lineage (store/lineage.py): the judge against a tiny oracle, the manifest's
``lineage`` field, and the root's generation counter (store/generation.py)."""

from __future__ import annotations

import math
import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flashckpt.errors import ConfigError, ManifestError
from flashckpt.store.files.backend import LocalBackend
from flashckpt.store.format.lineage import LEGACY, Lineage, parse_lineage
from flashckpt.store.format.manifest import Manifest
from flashckpt.store.format.parse import parse_manifest
from flashckpt.store.generation import GENERATION_NAME, read_generation, take_generation
from flashckpt.store.lineage import (
    ABANDONED,
    LIVE,
    SUPERSEDED,
    Copy,
    copy_lineage,
    judge,
    newest_recorded,
)
from flashckpt.store.store import CheckpointStore


def lin(g: int, pg: int | None = None, ps: int | None = None) -> Lineage:
    if g and pg is None:
        pg = g - 1
    return Lineage(generation=g, parent_generation=pg, parent_step=ps)


def cp(step: int, tier: int, lineage: Lineage | None) -> Copy[int]:
    return Copy(step=step, where=tier, order=tier, lineage=lineage)


# -- the oracle: walks the generations one by one, from the newest down ----------------------
def oracle(copies: list[Copy[int]]) -> dict[Copy[int], str]:
    first: dict[int, tuple[int, Lineage]] = {}
    for c in copies:
        if c.lineage is not None:
            g = c.lineage.generation
            if g not in first or c.step < first[g][0]:
                first[g] = (c.step, c.lineage)
    out: dict[Copy[int], str] = {}
    if not first:
        return {c: LIVE for c in copies}
    newest = max(first)
    allowed: dict[int, float] = {}
    cur, bound = newest, math.inf
    for g in range(newest, -1, -1):
        if g != cur:
            continue
        allowed[g] = bound
        if g == 0:
            break
        link = first[g][1] if g in first else None
        if link is not None and link.parent_step is not None:
            bound = min(bound, link.parent_step)
            cur = link.parent_generation  # type: ignore[assignment]
        else:
            cur = g - 1
    best: dict[int, int] = {}
    for c in copies:
        if c.lineage is not None and c.step <= allowed.get(c.lineage.generation, -math.inf):
            best[c.step] = max(best.get(c.step, -1), c.lineage.generation)
    for c in copies:
        if c.lineage is None:
            out[c] = LIVE
        elif c.step > allowed.get(c.lineage.generation, -math.inf):
            out[c] = ABANDONED
        else:
            out[c] = LIVE if best[c.step] == c.lineage.generation else SUPERSEDED
    return out


@st.composite
def copy_sets(draw: st.DrawFn) -> list[Copy[int]]:
    ngen = draw(st.integers(0, 6))
    links = {0: LEGACY}
    for g in range(1, ngen + 1):
        ps = draw(st.one_of(st.none(), st.integers(-1, 9)))
        pg = draw(st.integers(0, g - 1)) if ps is not None else g - 1
        links[g] = Lineage(generation=g, parent_generation=pg, parent_step=ps)
    copies = set()
    for _ in range(draw(st.integers(0, 14))):
        g = draw(st.integers(0, ngen))
        step, tier = draw(st.integers(0, 9)), draw(st.integers(0, 2))
        kind = draw(st.sampled_from(["own", "own", "own", "other", "unreadable"]))
        lineage: Lineage | None = links[g]
        if kind == "other" and g > 0:  # a manifest that disagrees with its generation's link
            lineage = Lineage(
                generation=g, parent_generation=0, parent_step=draw(st.integers(-1, 9))
            )
        elif kind == "unreadable":
            lineage = None
        copies.add(cp(step, tier, lineage))
    return sorted(copies, key=lambda c: (c.step, c.order, str(c.lineage)))


@settings(max_examples=1500, deadline=None)
@given(copy_sets())
def test_judge_matches_the_oracle(copies: list[Copy[int]]) -> None:
    got = judge(copies)
    assert got.verdicts == oracle(copies)
    for step, live in got.live.items():
        assert all(c.step == step for c in live)
        readable = [c for c in live if c.lineage is not None]
        assert len({c.lineage.generation for c in readable if c.lineage}) <= 1
        assert [c.order for c in readable] == sorted(c.order for c in readable)
        assert live[: len(readable)] == readable  # unreadable copies come last
    assert sum(len(v) for v in got.live.values()) + len(got.dropped) == len(copies)


def test_the_requeued_run_scenario() -> None:
    """Run 1 (gen 1) saved 1..6 in memory A, 3 and 6 reached disk... no: only 3; run 2 (gen 2)
    restored 3 from disk and saved 4..6 to disk; run 3 judges A (tier 0) + disk (tier 1)."""
    g1, g2 = lin(1, 0, None), lin(2, 1, 3)
    copies = [cp(s, 0, g1) for s in range(1, 7)] + [cp(3, 1, g1)]
    copies += [cp(s, 1, g2) for s in (4, 5, 6)]
    got = judge(copies)
    assert {c.step for c in got.dropped} == {4, 5, 6}
    assert all(c.where == 0 and got.verdicts[c] == ABANDONED for c in got.dropped)
    assert max(got.live) == 6 and [c.where for c in got.live[6]] == [1]
    assert got.generation(6) == 2 and got.generation(3) == 1
    assert [c.where for c in got.live[3]] == [0, 1]  # one generation: tier order


def test_tiers_disagreeing_on_a_step_are_decided_by_lineage_not_order() -> None:
    # both live (run 2 never restored: unknown branch), the fastest tier holds the older
    for fast_gen, slow_gen in ((1, 2), (2, 1)):
        copies = [cp(5, 0, lin(fast_gen)), cp(5, 1, lin(slow_gen))]
        got = judge(copies)
        (winner,) = got.live[5]
        assert winner.lineage is not None and winner.lineage.generation == 2
        (loser,) = got.dropped
        assert got.verdicts[loser] == SUPERSEDED


def test_a_fresh_start_abandons_every_older_generation() -> None:
    copies = [cp(s, 0, LEGACY) for s in (1, 2, 9)] + [cp(s, 0, lin(1)) for s in (3, 8)]
    copies += [cp(2, 1, lin(2, 1, -1))]
    got = judge(copies)
    assert list(got.live) == [2] and got.generation(2) == 2
    assert len(got.dropped) == 5


def test_unknown_branch_points_abandon_nothing() -> None:
    copies = [cp(s, 0, LEGACY) for s in (1, 2)] + [cp(s, 1, lin(3)) for s in (5,)]
    got = judge(copies)
    assert sorted(got.live) == [1, 2, 5] and not got.dropped


def test_a_generation_off_the_chain_is_abandoned() -> None:
    # gen 2 branched from gen 1 at 4 and saved 5..7 (node B); gen 3 restored gen 1's 6 (node A)
    copies = [cp(s, 1, lin(1)) for s in (4, 6)] + [cp(s, 2, lin(2, 1, 4)) for s in (5, 7)]
    copies += [cp(8, 0, lin(3, 1, 6))]
    got = judge(copies)
    assert sorted(got.live) == [4, 6, 8]
    assert {(c.step, c.where) for c in got.dropped} == {(5, 2), (7, 2)}


def test_no_copies() -> None:
    got = judge([])
    assert got.live == {} and got.dropped == [] and got.newest == 0


# -- the manifest's lineage field -----------------------------------------------------------
def test_manifest_roundtrip_and_legacy() -> None:
    m = Manifest(step=4, time_s=1.0, lineage=lin(3, 1, 2))
    back = parse_manifest(m.to_json())
    assert back.lineage == lin(3, 1, 2) and back.run_lineage == lin(3, 1, 2)
    old = parse_manifest(Manifest(step=4, time_s=1.0).to_json())
    assert old.lineage is None and old.run_lineage == LEGACY


@pytest.mark.parametrize(
    "bad",
    [
        None,
        [],
        {"generation": 1},
        {"generation": 1, "parent_generation": 0, "parent_step": None, "x": 1},
        {"generation": 0, "parent_generation": None, "parent_step": None},
        {"generation": 2, "parent_generation": 2, "parent_step": 1},
        {"generation": 2, "parent_generation": -1, "parent_step": 1},
        {"generation": 2, "parent_generation": None, "parent_step": 1},
        {"generation": 2, "parent_generation": 1, "parent_step": -2},
        {"generation": True, "parent_generation": 0, "parent_step": None},
        {"generation": 1.0, "parent_generation": 0, "parent_step": None},
        {"generation": 10**16, "parent_generation": 0, "parent_step": None},
        {"generation": 2, "parent_generation": 1, "parent_step": "3"},
    ],
)
def test_malformed_lineage_is_refused(bad: object) -> None:
    with pytest.raises(ManifestError, match="lineage"):
        parse_lineage(bad, "m")
    doc = Manifest(step=1, time_s=1.0).to_json()[:-1] + b',"lineage":' + _dumps(bad) + b"}"
    with pytest.raises(ManifestError, match="lineage"):
        parse_manifest(doc)


def _dumps(v: object) -> bytes:
    import json

    return json.dumps(v).encode()


def test_copy_lineage_reads_only_the_lineage(tmp_path) -> None:
    store = CheckpointStore(LocalBackend(tmp_path))
    store.commit(Manifest(step=2, time_s=1.0, lineage=lin(4, 2, 1)), chunk_dirs=[])
    store.commit(Manifest(step=3, time_s=1.0), chunk_dirs=[])
    (tmp_path / "steps" / "000000000005.json").write_bytes(b"{not json")
    assert copy_lineage(store, 2) == lin(4, 2, 1)
    assert copy_lineage(store, 3) == LEGACY
    assert copy_lineage(store, 5) is None  # damage: the load reports it
    assert copy_lineage(store, 7) is None
    assert newest_recorded(store) == 4


def test_copy_lineage_reads_the_head_of_a_manifest_not_all_of_it(tmp_path, monkeypatch) -> None:
    """Judging every copy parsed every manifest whole: 1.2 s per copy for 50k tensors (8 MB).
    A manifest opens with its lineage, so the judge reads its first 4 KiB; a manifest written
    with the lineage elsewhere (an older build, or edited) is still read whole, and agrees."""
    import json

    store = CheckpointStore(LocalBackend(tmp_path))
    big = Manifest(step=2, time_s=1.0, lineage=lin(4, 2, 1), meta={"pad": "x" * (1 << 20)})
    store.commit(big, chunk_dirs=[])
    reads: list[str] = []
    real = store.backend.read
    monkeypatch.setattr(store.backend, "read", lambda p: reads.append(p) or real(p))
    assert copy_lineage(store, 2) == lin(4, 2, 1) and reads == []
    doc = json.loads(Manifest(step=3, time_s=1.0).to_json())
    doc["lineage"] = lin(5, 4, 2).to_json()  # at the end, as the first lineage build wrote it
    (tmp_path / "steps" / "000000000003.json").write_text(json.dumps(doc))
    assert copy_lineage(store, 3) == lin(5, 4, 2) and len(reads) == 1
    bad = Manifest(step=4, time_s=1.0, lineage=lin(4, 2, 1)).to_json()
    bad = bad.replace(b'"parent_step":1', b'"parent_step":-7')
    (tmp_path / "steps" / "000000000004.json").write_bytes(bad)
    assert copy_lineage(store, 4) is None  # malformed at the head: the full parser's verdict


# -- ROOT/generation ------------------------------------------------------------------------
def test_generation_counts_up_and_survives(tmp_path) -> None:
    assert read_generation(tmp_path) is None
    assert [take_generation(tmp_path) for _ in range(3)] == [1, 2, 3]
    assert read_generation(tmp_path) == 3
    assert not [p for p in os.listdir(tmp_path) if ".tmp-" in p]


def test_a_missing_generation_continues_above_the_manifests(tmp_path) -> None:
    assert take_generation(tmp_path, floor=lambda: 7) == 8
    assert take_generation(tmp_path, floor=lambda: 100) == 9  # the file wins once it exists


@pytest.mark.parametrize("kind", ["garbage", "json", "huge", "symlink", "fifo", "dir", "neg"])
def test_a_hostile_generation_file_is_refused_clearly(tmp_path, kind: str) -> None:
    p = tmp_path / GENERATION_NAME
    target = tmp_path / "elsewhere"
    target.write_text('{"version": 1, "generation": 5}')
    if kind == "garbage":
        p.write_bytes(b"\x00\xffgarbage")
    elif kind == "json":
        p.write_text('{"version": 1, "generation": "5"}')
    elif kind == "neg":
        p.write_text('{"version": 1, "generation": -3}')
    elif kind == "huge":
        p.write_bytes(b" " * (1 << 20))
    elif kind == "symlink":
        p.symlink_to(target)
    elif kind == "fifo":
        os.mkfifo(p)
    else:
        p.mkdir()
    with pytest.raises(ConfigError, match=GENERATION_NAME) as err:
        take_generation(tmp_path)
    assert "remove it" in str(err.value).lower()
    assert target.read_text() == '{"version": 1, "generation": 5}'  # never followed
