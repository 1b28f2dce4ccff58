"""``flashckpt run``: bad usage is one line and exit 2; the script's exit code is the launcher's;
restarts are bounded by --max-restarts (the standby behaviour: tests/distributed/standby/)."""

from __future__ import annotations

import sys

import pytest

from flashckpt.cli import main


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["run"], "needs a command after --"),
        (["run", "--"], "needs a command after --"),
        (["run", "--nproc-per-node", "0", "--", "true"], "expected a number of ranks in 1..1024"),
        (["run", "--standby", "2", "--", "true"], "expected 0 or 1 in 0..1"),
        (
            ["run", "--max-restarts", "-1", "--", "true"],
            "expected a number of restarts in 0..1000000",
        ),
    ],
)
def test_bad_usage_is_one_line_and_exit_2(argv, says, capsys) -> None:
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse refuses a bad number (cli/argtypes.py): usage + 1 line
        code = exc.code
    assert code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert says in err.strip().splitlines()[-1]


def test_the_scripts_exit_code_and_bounded_restarts(tmp_path, capsys) -> None:
    runs = tmp_path / "runs"
    script = (
        f"import pathlib, sys; p = pathlib.Path({str(runs)!r}); "
        "p.write_text((p.read_text() if p.exists() else '') + 'x'); sys.exit(7)"
    )
    cmd = ["--", sys.executable, "-c", script]
    assert main(["run", "--standby", "0", "--max-restarts", "2", *cmd]) == 7
    assert runs.read_text() == "xxx"  # the first run and two restarts
    assert "no restarts left" in capsys.readouterr().out
    assert main(["run", "--standby", "0", "--", sys.executable, "-c", "pass"]) == 0


def test_the_launcher_does_not_import_torch() -> None:
    """The launcher starts the job and stays beside it: importing every command module (several
    import torch) cost 0.8 s of CPU on each job start and memory for the whole run."""
    import subprocess

    code = (
        "import sys; from flashckpt.cli import main; "
        "rc = main(['run', '--standby', '0', '--', sys.executable, '-c', 'pass']); "
        "print(rc, sorted(m for m in ('torch', 'numpy') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "0 []"


def test_the_other_commands_still_parse_with_the_launcher_alone() -> None:
    from flashckpt.cli import build_parser

    assert build_parser().parse_args(["status", "r"]).command == "status"
    with pytest.raises(SystemExit):  # only run's parser: another command is unknown to it
        build_parser("run").parse_args(["status", "r"])
