"""One canonical step name: a file in steps/ is a step only under the exact name the writer gives
it (store/format/names.py); anything else is ignored by every reader and reported by verify."""

from __future__ import annotations

import contextlib
import io

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

import flashckpt
from flashckpt.cli import main
from flashckpt.store.format.names import (
    parse_part_name,
    parse_step_name,
    part_name,
    step_name,
    stray_step_names,
)
from hostile.util import manifest_path, small_state

pytestmark = pytest.mark.timeout(120)

NON_CANONICAL = [
    "9.json",  # unpadded
    "0000000000009.json",  # 13 digits: an extra leading zero
    "000000000009.json\n",  # trailing newline ($ alone would accept it)
    "\u0661\u0662\u0663\u0664\u0665\u0666\u0667\u0668\u0669\u0660\u0661\u0662.json",  # Arabic-Indic
    "００００００００００09.json",  # fullwidth digits
    "000000000009.JSON",
    "000000000009.json.bak",
    " 000000000009.json",
    "+00000000009.json",
    "0000000000009999.json",  # 16 digits
]


@settings(max_examples=300, derandomize=True, deadline=None)
@given(st.integers(min_value=0, max_value=10**15 - 1))
def test_every_written_name_parses_back_to_its_step(step):
    assert parse_step_name(step_name(step).removeprefix("steps/")) == step
    assert parse_part_name(part_name(step, 3).removeprefix("steps/")) == (step, 3)


@settings(max_examples=500, derandomize=True, deadline=None)
@given(st.text(max_size=24))
@example("9.json")
@example("0000000000009.json")
@example("000000000009.json\n")
@example("٠٠٠٠٠٠٠٠٠٠٠٩.json")
def test_a_name_is_a_step_only_if_it_is_the_name_written_for_that_step(name):
    step = parse_step_name(name)
    if step is not None:
        assert step_name(step) == f"steps/{name}"
    part = parse_part_name(name)
    if part is not None:
        assert part_name(*part) == f"steps/{name}"


@settings(max_examples=300, derandomize=True, deadline=None)
@given(
    st.integers(min_value=0, max_value=10**12),
    st.sampled_from(["0", "", "\n", " ", "x", "\u0660"]),
    st.sampled_from(["prefix", "suffix"]),
)
def test_padding_or_decoration_of_a_real_name_is_never_a_step(step, extra, where):
    base = step_name(step).removeprefix("steps/")
    name = extra + base if where == "prefix" else base + extra
    if name == base:
        return
    assert parse_step_name(name) is None  # an extra leading zero is another width, too
    assert name in stray_step_names([name])


@pytest.mark.parametrize("name", NON_CANONICAL)
def test_planted_non_canonical_names_are_ignored_by_readers_and_reported_by_verify(tmp_path, name):
    root = tmp_path / "root"
    with flashckpt.Checkpointer(root) as ckpt:
        ckpt.save(5, small_state(5.0))
    # a copy of a real manifest under a name that is not canonical
    (root / "steps" / name).write_bytes(manifest_path(root, 5).read_bytes())
    with flashckpt.Checkpointer(root) as ckpt:
        assert ckpt.steps() == [5]
    state = small_state()
    assert flashckpt.restore(root, state) == 5  # read-only restore: never "all deleted"
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["inspect", str(root)]) == 0
    assert "step 5" in out.getvalue()
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["verify", str(root)]) == 0
    assert "not a canonical step name" in out.getvalue()
    assert repr(name) in out.getvalue()
    assert "1 of 1 checkpoints ok" in out.getvalue()


def test_only_a_non_canonical_name_means_no_checkpoint(tmp_path):
    root = tmp_path / "root"
    with flashckpt.Checkpointer(root) as ckpt:
        ckpt.save(9, small_state(9.0))
    real = manifest_path(root, 9)
    (root / "steps" / "9.json").write_bytes(real.read_bytes())
    real.unlink()
    assert flashckpt.restore(root, small_state()) is None
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert main(["inspect", str(root)]) == 2
    assert "Traceback" not in err.getvalue()
