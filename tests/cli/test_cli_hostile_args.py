"""Every command, every option: argument vectors built from the argparse definition itself (so a
new option is covered the day it is added), with hostile numbers (nan, inf, -1, 0, 1e308, 1e-9,
400 digits), special files (a FIFO, /dev/zero, /dev/urandom, a directory, a sparse file) and
missing paths. Each run ends within seconds in exit 0/1 (legitimate input) or 2, with at most one
error line and no traceback.

The commands that train or benchmark for minutes on legitimate input (demo, bench, chaos) are
parsed, not run; what keeps them safe is that every number they take goes through a validating
type of ``flashckpt.cli.argtypes`` (checked below for every option of every command), and the
named regressions (``chaos --minutes nan`` hung, ``--mtbf-s inf`` divided by zero) are run.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import signal
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import flashckpt
from flashckpt.cli import argtypes, build_parser, main

pytestmark = pytest.mark.timeout(600)

LONG = {"demo", "bench", "chaos"}  # minutes of work on legitimate input: parsed only
RUN_TIMEOUT_S = 20  # a hang is caught long before pytest's timeout
NUMBERS = ["nan", "-nan", "inf", "-inf", "-1", "0", "1", "1e308", "1e-9", "9" * 400, "0x10", "٣"]


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    raise AssertionError("no subcommands")


PARSER = build_parser()
COMMANDS = _subparsers(PARSER)


def _options(sub: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in sub._actions if not isinstance(a, argparse._HelpAction)]


@pytest.fixture(autouse=True)
def _in_a_scratch_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Commands run with their default outputs (``report`` writes ./report.html): in a
    scratch directory, never in the checkout."""
    monkeypatch.chdir(tmp_path)


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    d = tmp_path_factory.mktemp("hostile-args")
    root = d / "root"
    with flashckpt.Checkpointer(root) as ckpt:
        ckpt.save(1, {"model": torch.nn.Linear(4, 4)})
        ckpt.save(2, {"model": torch.nn.Linear(4, 4)})
    os.mkfifo(d / "fifo")
    (d / "dir").mkdir()
    with open(d / "sparse.json", "wb") as f:
        f.truncate(1_342_177_280)
    (d / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": 2}))
    return {
        "root": str(root),
        "fifo": str(d / "fifo"),
        "zero": "/dev/zero",
        "urandom": "/dev/urandom",
        "dir": str(d / "dir"),
        "sparse": str(d / "sparse.json"),
        "missing": str(d / "missing" / "x"),
        "config": str(d / "config.json"),
        "journal": str(root / "journal.jsonl"),
        "new-out": str(d / "out"),
    }


def _is_number_type(action: argparse.Action) -> bool:
    return (
        action.type in (int, float) or getattr(action.type, "__module__", "") == argtypes.__name__
    )


def _value(draw: Any, action: argparse.Action, files: dict[str, str]) -> str:
    if action.choices is not None:
        return draw(st.sampled_from([str(c) for c in action.choices] + ["bogus"]))
    if _is_number_type(action):
        return draw(st.sampled_from(NUMBERS))
    if action.type is not None:
        return draw(st.sampled_from(NUMBERS + list(files.values())))
    return draw(st.sampled_from([*files.values(), "model", "", "-"]))


@st.composite
def argv_for(draw: Any, command: str, files: dict[str, str]) -> list[str]:
    argv = [command]
    for action in _options(COMMANDS[command]):
        if not action.option_strings:  # positional
            argv.append(_value(draw, action, files))
            continue
        if not action.required and not draw(st.booleans()):
            continue
        flag = action.option_strings[-1]
        if action.nargs == 0:
            argv.append(flag)
        else:
            argv += [flag, _value(draw, action, files)]
    return argv


class _Hung(Exception):
    pass


def _alarm(signum: int, frame: Any) -> None:
    raise _Hung


def run_in_process(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    old = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(RUN_TIMEOUT_S)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                rc = main(argv)
            except SystemExit as exc:  # argparse: usage errors exit 2
                rc = int(exc.code or 0)
    except _Hung:
        pytest.fail(f"flashckpt {' '.join(argv)} did not finish within {RUN_TIMEOUT_S} s")
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    return rc, out.getvalue(), err.getvalue()


def check_outcome(argv: list[str], rc: int, out: str, err: str) -> None:
    where = f"flashckpt {' '.join(argv)}"
    assert "Traceback" not in out + err, f"{where}: traceback\n{err}"
    assert rc in (0, 1, 2), f"{where}: exit {rc}\n{err}"
    if rc == 2:
        errors = [ln for ln in err.splitlines() if "error" in ln.lower()]
        assert len(errors) == 1, f"{where}: expected one error line, got\n{err}"
        assert errors[0].startswith("flashckpt"), f"{where}: {errors[0]}"


SETTINGS = settings(
    max_examples=12,
    derandomize=True,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@pytest.mark.parametrize("command", sorted(set(COMMANDS) - LONG))
def test_every_option_of_every_command_with_hostile_values(command, files):
    @SETTINGS
    @given(data=st.data())
    def run(data: st.DataObject) -> None:
        argv = data.draw(argv_for(command, files))
        check_outcome(argv, *run_in_process(argv))

    run()


@pytest.mark.parametrize("command", sorted(LONG))
def test_long_commands_refuse_every_hostile_number_at_parse_time(command, files):
    @SETTINGS
    @given(data=st.data())
    def run(data: st.DataObject) -> None:
        argv = data.draw(argv_for(command, files))
        err = io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            try:
                args = PARSER.parse_args(argv)
            except SystemExit as exc:
                assert exc.code == 2
                check_outcome(argv, 2, "", err.getvalue())
                return
        for value in vars(args).values():  # what reaches the command is a sane number
            if isinstance(value, float):
                assert value == value and abs(value) < float("inf"), argv
            if isinstance(value, int) and not isinstance(value, bool):
                assert abs(value) < 1 << 63, argv

    run()


def test_every_numeric_option_uses_a_validating_type():
    """A new ``type=float`` option would let nan and inf through: every number goes through
    one of the shared kinds in flashckpt.cli.argtypes (or has choices)."""
    loose = [
        f"{name} {action.option_strings or action.dest}"
        for name, sub in COMMANDS.items()
        for action in _options(sub)
        if action.type in (int, float) and action.choices is None
    ]
    assert loose == []


@pytest.mark.parametrize(
    "argv",
    [
        ["chaos", "--minutes", "nan"],
        ["chaos", "--mtbf-s", "nan"],
        ["chaos", "--minutes", "inf"],
        ["chaos", "--mtbf-s", "1e-9"],
        ["chaos", "--mtbf-s", "inf"],
        ["chaos", "--minutes", "-1"],
        ["status", "ROOT", "--gpu-hour-price", "nan"],
        ["plan", "--model", "gpt2", "--gpu", "rtx4090", "--batch", "0", "--seq", "1024"],
        ["ls", "ROOT", "--step", "1"],
    ],
)
def test_named_hostile_numbers_exit_2_with_one_line(argv, files):
    argv = [files["root"] if a == "ROOT" else a for a in argv]
    rc, out, err = run_in_process(argv)
    if argv[:3] == ["ls", files["root"], "--step"]:
        assert rc == 2  # ls takes no --step: a usage error, one line
    check_outcome(argv, rc, out, err)
    assert rc == 2


@pytest.mark.parametrize("kind", ["fifo", "zero", "urandom", "sparse", "dir"])
def test_export_hf_config_and_plan_model_special_files(files, kind, tmp_path):
    """export --format hf --config hung on a FIFO or /dev/urandom and ended in a traceback on
    /dev/zero; plan --model CONFIG.json read any file whole."""
    argv = ["export", files["root"], str(tmp_path / "o"), "--format", "hf", "--config", files[kind]]
    rc, out, err = run_in_process(argv)
    check_outcome(argv, rc, out, err)
    assert rc == 2
    model = files[kind] if files[kind].endswith(".json") else files[kind] + "/../x.json"
    if kind in ("fifo", "zero", "urandom"):
        link = tmp_path / "model.json"
        link.symlink_to(files[kind])
        model = str(link)
    argv = ["plan", "--model", model, "--gpu", "rtx4090", "--batch", "1", "--seq", "16"]
    rc, out, err = run_in_process(argv)
    check_outcome(argv, rc, out, err)
    assert rc == 2


def test_run_chaos_refuses_nan_and_inf_itself(tmp_path):
    from flashckpt.demo.chaos import run_chaos

    for minutes, mtbf in ((float("nan"), 300.0), (1.0, float("nan")), (float("inf"), 300.0),
                          (1.0, float("inf")), (1.0, 1e-9)):  # fmt: skip
        with pytest.raises(flashckpt.ConfigError, match="chaos needs"):
            run_chaos(out=tmp_path, minutes=minutes, mtbf_s=mtbf)
    assert not list(Path(tmp_path).iterdir())
