"""``flashckpt run --standby 1`` with real processes and real SIGKILLs (standby_worker.py).

Each test starts the launcher, waits until the standby is ready (everything built, waiting in
restore()), kills the active process with SIGKILL at a given step and checks that the standby
took over: the state it restored is bitwise the state saved at that step, training continues at
the next step, the run finishes, and the journal has the takeover and its restart parts.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from flashckpt.journal import read_events

WORKER = Path(__file__).with_name("standby_worker.py")
TIMEOUT_S = 120.0


class Launch:
    def __init__(self, out: Path, steps: int, *, nproc: int = 1, standby: int = 1) -> None:
        self.out, self.steps, self.nproc = out, steps, nproc
        self.state_file = out / "launcher.json"
        cmd = [sys.executable, "-m", "flashckpt.cli", "run", "--standby", str(standby)]
        cmd += ["--nproc-per-node", str(nproc), "--state-file", str(self.state_file)]
        cmd += ["--", sys.executable, str(WORKER), str(out), str(steps)]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)

    def state(self) -> dict:
        try:
            return json.loads(self.state_file.read_text())
        except (OSError, ValueError):
            return {}

    def events(self, rank: int = 0) -> list[dict]:
        path = self.out / f"events-{rank}.jsonl"
        if not path.exists():
            return []
        rows = []
        for line in path.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except ValueError:
                pass  # the line a killed process was writing
        return rows

    def until(self, what: str, cond, timeout_s: float = TIMEOUT_S):
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            got = cond()
            if got:
                return got
            if self.proc.poll() is not None:
                break
            time.sleep(0.01)
        self.proc.kill()
        log = self.proc.communicate()[0].decode(errors="replace")
        pytest.fail(f"timed out waiting for {what}; launcher said:\n{log}")

    def reached(self, step: int, pid: int | None = None) -> bool:
        return any(
            e["event"] == "step" and e["step"] >= step and (pid is None or e["pid"] == pid)
            for e in self.events()
        )

    def ready_standby(self) -> dict:
        return self.until("a ready standby", lambda: (s := self.state()).get("standby_ready") and s)

    def kill_active_at(self, step: int, *, rank: int = 0) -> int:
        """SIGKILL active rank ``rank`` once rank 0 reached ``step``; returns its pid."""
        st = self.state()
        pid = st["active"][rank]
        self.until(f"step {step}", lambda: self.reached(step, None if rank else pid))
        os.kill(pid, signal.SIGKILL)
        return pid

    def finish(self) -> tuple[int, str]:
        try:
            out = self.proc.communicate(timeout=TIMEOUT_S)[0].decode(errors="replace")
        except subprocess.TimeoutExpired:
            self.proc.kill()
            out = self.proc.communicate()[0].decode(errors="replace")
            pytest.fail(f"the launcher did not finish:\n{out}")
        return self.proc.returncode, out


def restored(launch: Launch, rank: int = 0) -> list[dict]:
    return [e for e in launch.events(rank) if e["event"] == "restored"]


def check_restores(launch: Launch, rank: int = 0) -> list[dict]:
    """Every restore loaded bitwise the state saved at its step, and training went on from the
    next step; returns the restores of a checkpoint."""
    rows = launch.events(rank)
    got = []
    for i, r in enumerate(rows):
        if r["event"] != "restored" or r["step"] == 0:
            continue
        saved = (launch.out / "digests" / f"{rank}-{r['step']}").read_text()
        assert r["digest"] == saved, f"rank {rank}: restored step {r['step']} differs"
        nxt = [e for e in rows[i + 1 :] if e["pid"] == r["pid"] and e["event"] == "step"]
        if nxt:
            assert nxt[0]["step"] == r["step"] + 1
        got.append(r)
    return got


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def takeovers(out: Path) -> list[dict]:
    return [e for e in read_events(out / "root") if e.get("event") == "takeover"]


def restarts(out: Path) -> list[dict]:
    return [e for e in read_events(out / "root") if e.get("event") == "restart"]


def test_takeover_after_sigkill(tmp_path: Path) -> None:
    launch = Launch(tmp_path, steps=30)
    standby_pid = launch.ready_standby()["standby"][0]
    killed = launch.kill_active_at(8)
    code, log = launch.finish()
    assert code == 0, log
    (r,) = check_restores(launch)
    assert (
        r["pid"] == standby_pid and r["was_standby"] and r["step"] >= 6
    )  # async: 8 may be in flight
    # the standby moved its model to the device only at the takeover (flashckpt.to_device)
    assert r["moves_before"] == 0 and r["moves_after"] == 1
    first = [e for e in launch.events() if e["event"] == "start" and e["pid"] == killed]
    assert first and not first[0]["standby"] and first[0]["policy"] == os.SCHED_OTHER
    # the standby started at idle priority and trains at normal priority after the takeover
    mine = [e for e in launch.events() if e["event"] == "start" and e["pid"] == standby_pid]
    assert mine[0]["policy"] == os.SCHED_IDLE and r["policy"] == os.SCHED_OTHER
    assert next(e for e in launch.events() if e["event"] == "done")["pid"] == standby_pid
    (tk,) = takeovers(tmp_path)
    assert tk["pid"] == standby_pid and tk["moved_modules"] == 1 and tk["priority_restored"]
    (rs,) = restarts(tmp_path)
    assert rs["takeover"] is True and rs["restored_step"] == r["step"]
    parts = rs["wait_s"] + rs["open_s"] + rs["restore_s"] + rs["first_step_s"]
    assert rs["restart_seconds"] == pytest.approx(parts, abs=1e-5)
    assert launch.state()["takeovers"] == 1 and launch.state()["cold_restarts"] == 0


def test_takeovers_through_the_device_staging_standin(tmp_path: Path) -> None:
    """With the CPU stand-in for CUDA (every tensor staged through the device path), a standby
    takes over, saves as the active process, and the next standby restores what it saved."""
    (tmp_path / "standin").touch()
    launch = Launch(tmp_path, steps=600)  # long enough for a second standby to get ready, loaded
    launch.ready_standby()
    launch.kill_active_at(5)
    first = launch.until("the first takeover", lambda: restored(launch)[1:] and restored(launch)[1])
    launch.ready_standby()
    launch.kill_active_at(first["step"] + 5)
    code, log = launch.finish()
    assert code == 0, log
    rows = check_restores(launch)
    assert len(rows) == 2 and rows[1]["step"] > first["step"]  # saved by the first standby
    assert all(r["was_standby"] and r["moves_before"] == 0 for r in rows)
    done = next(e for e in launch.events() if e["event"] == "done")
    assert done["pid"] == rows[1]["pid"] and done["device_calls"] > 0  # the stand-in staged


def test_clean_exit_ends_the_standby(tmp_path: Path) -> None:
    launch = Launch(tmp_path, steps=6)
    standby_pid = launch.ready_standby()["standby"][0]
    code, log = launch.finish()
    assert code == 0, log
    assert not alive(standby_pid)
    assert not restored(launch)[1:], "the standby must never restore after a clean exit"
    assert not takeovers(tmp_path)
    assert [e["pid"] for e in launch.events() if e["event"] == "done"] != [standby_pid]


def test_the_standby_shares_the_active_runs_scheduler_group(tmp_path: Path) -> None:
    """Regression: each member ran in a session of its own, and Linux's autogroups share the
    CPU fairly between sessions before a task's policy counts: the standby, at ``SCHED_IDLE``,
    still took up to half the cores, and its start-up slowed the active run's step 2.2-2.6 s
    (benchmarks/standby_interference.py). Both now lead their own process group (the launcher
    still ends each with one killpg) inside the launcher's session, so they share one group."""
    launch = Launch(tmp_path, steps=6)
    standby_pid = launch.ready_standby()["standby"][0]
    code, log = launch.finish()
    assert code == 0, log
    starts = {e["pid"]: e for e in launch.events() if e["event"] == "start"}
    spare = starts[standby_pid]
    (active,) = [e for pid, e in starts.items() if pid != standby_pid]
    assert spare["standby"] and not active["standby"] and spare["policy"] == os.SCHED_IDLE
    for member in (active, spare):  # the launcher is in this test's session and group
        assert member["pgid"] == member["pid"] != os.getpgid(0)  # killpg ends it alone
        assert member["sid"] == os.getsid(0)
    # The scheduler group is this test's: the kernel prints none (None) for the default group
    # that a container's processes may share, and a new one for every new session.
    assert spare["autogroup"] == active["autogroup"] == own_autogroup()


def own_autogroup() -> str | None:
    """This process's autogroup as the worker reads its own (``/autogroup-N``), or None where
    the kernel has none or prints none (the default group, a kernel without autogroups)."""
    try:
        return Path("/proc/self/autogroup").read_text().split()[0]
    except (OSError, IndexError):
        return None


def test_crash_in_the_first_resumed_step(tmp_path: Path) -> None:
    """The standby takes over and crashes in its first step: no next standby was started yet
    (it starts only after the first step), so the restart is cold, and still bitwise."""
    (tmp_path / "crash_first_step").touch()
    launch = Launch(tmp_path, steps=30)
    launch.ready_standby()
    launch.kill_active_at(6)
    code, log = launch.finish()
    assert code == 0, log
    assert [e for e in launch.events() if e["event"] == "crashing"], "the crash did not happen"
    rows = check_restores(launch)
    assert len(rows) == 2 and rows[0]["was_standby"] and not rows[1]["was_standby"]
    st = launch.state()
    assert (st["restarts"], st["takeovers"], st["cold_restarts"]) == (2, 1, 1)
    assert [e for e in launch.events() if e["event"] == "done"]


def test_standby_start_failure_never_affects_the_active_run(tmp_path: Path) -> None:
    (tmp_path / "fail_standby").touch()
    launch = Launch(tmp_path, steps=20)  # it ends once the launcher gave up on standbys
    code, log = launch.finish()
    assert code == 0, log
    starts = [e for e in launch.events() if e["event"] == "start"]
    assert len({e["pid"] for e in starts if not e["standby"]}) == 1  # never restarted
    assert len([e for e in starts if e["standby"]]) == 3, log
    assert "no more standbys" in log
    steps = [e["step"] for e in launch.events() if e["event"] == "step"]
    assert steps == list(range(1, 21))
    assert launch.state()["standby_failures"] == 3 and launch.state()["restarts"] == 0


def test_two_quick_failures_in_a_row(tmp_path: Path) -> None:
    """The active dies; the standby takes over and is killed right after its restore, before
    its first step: no next standby was started yet, so the launcher restarts cold."""
    (tmp_path / "pause_resumed").touch()  # the takeover waits before its first step
    launch = Launch(tmp_path, steps=30)
    launch.ready_standby()
    launch.kill_active_at(5)
    second = launch.until("the takeover", lambda: restored(launch)[1:] and restored(launch)[1])
    os.kill(second["pid"], signal.SIGKILL)
    (tmp_path / "pause_resumed").unlink()
    assert not launch.reached(second["step"] + 1, second["pid"])  # killed before its first step
    code, log = launch.finish()
    assert code == 0, log
    rows = check_restores(launch)
    assert len(rows) == 2 and rows[0]["pid"] == second["pid"] and not rows[1]["was_standby"]
    st = launch.state()
    assert (st["restarts"], st["takeovers"], st["cold_restarts"]) == (2, 1, 1)


def standby_starts(launch: Launch) -> list[dict]:
    return [e for e in launch.events() if e["event"] == "start" and e["standby"]]


def test_the_next_standby_starts_only_after_the_first_step(tmp_path: Path) -> None:
    """A standby's imports and model building would compete with a start, a restore and a
    first step: the launcher starts it only once the active process stepped (role.say_stepped)."""
    launch = Launch(tmp_path, steps=200)
    launch.ready_standby()
    killed = launch.kill_active_at(5)
    launch.until("the second standby", lambda: standby_starts(launch)[1:])
    launch.proc.send_signal(signal.SIGTERM)
    launch.finish()
    rows = launch.events()
    took = next(e for e in rows if e["event"] == "restored" and e["was_standby"])
    for active, standby in (
        (killed, standby_starts(launch)[0]),
        (took["pid"], standby_starts(launch)[1]),
    ):
        first = next(e for e in rows if e["event"] == "step" and e["pid"] == active)
        assert standby["t"] >= first["t"], (first, standby)
    assert standby_starts(launch)[1]["t"] >= took["t"]


def test_a_failure_before_the_next_standby_is_ready_waits_for_it(tmp_path: Path) -> None:
    """The new active dies after its first step, while the next standby is started but not yet
    ready: that standby is told go at once and takes over when it reaches restore()."""
    (tmp_path / "slow_standby").touch()
    launch = Launch(tmp_path, steps=150)  # the kill must land before it ends, loaded
    launch.ready_standby()
    launch.kill_active_at(5)
    second = launch.until("the takeover", lambda: restored(launch)[1:] and restored(launch)[1])
    launch.until("its first step", lambda: launch.reached(second["step"] + 1, second["pid"]))
    third = launch.until("the next standby's start", lambda: standby_starts(launch)[1:])[0]
    assert not launch.state().get("standby_ready")  # it sleeps 3 s after its start event
    os.kill(second["pid"], signal.SIGKILL)
    code, log = launch.finish()
    assert code == 0, log
    rows = check_restores(launch)
    assert [r["pid"] for r in rows] == [second["pid"], third["pid"]], rows
    assert all(r["was_standby"] for r in rows)
    st = launch.state()
    assert (st["restarts"], st["takeovers"], st["cold_restarts"]) == (2, 2, 0)


@pytest.mark.parametrize("victim", [0, 1])
def test_two_ranks_take_over_on_a_fresh_group(tmp_path: Path, victim: int) -> None:
    launch = Launch(tmp_path, steps=25, nproc=2)
    st = launch.ready_standby()
    launch.kill_active_at(6, rank=victim)
    code, log = launch.finish()
    assert code == 0, log
    for rank in (0, 1):
        (r,) = check_restores(launch, rank)
        assert r["pid"] == st["standby"][rank] and r["was_standby"]
        assert next(e for e in launch.events(rank) if e["event"] == "done")["pid"] == r["pid"]
    assert len(takeovers(tmp_path)) == 2  # one per rank
    assert [e["takeover"] for e in restarts(tmp_path)] == [True]  # counted once (rank 0)
