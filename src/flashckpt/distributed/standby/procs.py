"""The launcher's processes: one set of ranks (active or standby) started, watched, ended.

Every member leads a process group of its own (``setpgid``), so ending it ends whatever it
started too (DataLoader workers, a shell's children) and a signal to the launcher's terminal does
not reach it twice. A standby member is started under ``SCHED_IDLE`` (its imports and model
building then only use CPU the active run leaves idle) where the launcher may take it back out
of it, else under ``SCHED_BATCH``
(:func:`~flashckpt.engine.cpupolicy.lowest_undoable_policy`), and gets two pipes: the
launcher's ``go`` line arrives on one, it says ``ready`` on the other. Every member, active or
standby, gets a third on which it says ``stepped`` at its first training step
(:func:`~.role.say_stepped`).

Every member stays in the launcher's *session*. Linux with ``CONFIG_SCHED_AUTOGROUP`` (the
default of most distributions) gives each session a scheduler group of its own and shares the
CPU fairly between groups *before* it looks at a task's policy: a standby in a session of its
own got up to half the cores at ``SCHED_IDLE``, and its start-up after every takeover cost the
active run's two-thread training 2.2-2.6 s on two vCPUs (``benchmarks/standby_interference.py``).
In one session, ``SCHED_IDLE`` means idle. (A member that reads the terminal is then a
background job: job control stops it, as it would stop ``cmd &``.)
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from flashckpt.distributed.standby import role as roles
from flashckpt.engine.cpupolicy import back_to_normal, lowest_undoable_policy


def free_port() -> int:
    """A TCP port on 127.0.0.1 nobody listens on now (a fresh rendezvous for a new set)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _own_group() -> None:  # runs in the child between fork and exec
    """A process group of its own in the launcher's session (the module docstring; Python
    3.10 has no ``process_group=``)."""
    os.setpgid(0, 0)


def _own_group_low(policy: int) -> Callable[[], None]:
    def setup() -> None:  # runs in the child between fork and exec
        _own_group()
        with contextlib.suppress(OSError, AttributeError):
            os.sched_setscheduler(0, policy, os.sched_param(0))

    return setup


def normal_priority(pid: int) -> None:
    """Every thread of process ``pid`` from ``SCHED_IDLE`` back to ``SCHED_OTHER`` (best effort:
    a thread may end meanwhile, and the kernel may refuse)."""
    try:
        tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except (OSError, ValueError):
        return
    for tid in tids:
        with contextlib.suppress(OSError, AttributeError):
            back_to_normal(tid)


@dataclass
class Member:
    """One process of a set: rank ``rank``; ``go_w``/``ready_r`` the standby's pipe ends."""

    proc: subprocess.Popen[bytes]
    rank: int
    go_w: int | None = None
    ready_r: int | None = None
    ready: bool = False
    stepped_r: int | None = None  # its first step is announced here (role.say_stepped)
    stepped: bool = False

    def poll(self) -> int | None:
        return self.proc.poll()

    def check_ready(self) -> bool:
        if not self.ready and self.ready_r is not None:
            try:
                got = os.read(self.ready_r, 64)
            except BlockingIOError:
                return False
            except OSError:
                got = b""
            self.ready = got.startswith(b"ready")
            if not self.ready and not got:  # closed without a word (it died, or took over)
                self._close_ready()
        return self.ready

    def check_stepped(self) -> bool:
        """Whether it said ``stepped`` (its first training step). A pipe closed without the word
        is not a step: the process died (the kernel closes its files a moment before the
        launcher can see its exit code, so a death must not read as "stepped" and start a
        standby that the failure then promotes), or its script closed the descriptor; the
        launcher's settle time covers the second case."""
        if self.stepped_r is not None:
            try:
                got = os.read(self.stepped_r, 64)  # ``stepped``, or end of file
            except BlockingIOError:
                return False
            except OSError:
                got = b""
            self.stepped = got.startswith(roles.STEPPED)
            with contextlib.suppress(OSError):
                os.close(self.stepped_r)
            self.stepped_r = None
        return self.stepped

    def _close_ready(self) -> None:
        if self.ready_r is not None:
            with contextlib.suppress(OSError):
                os.close(self.ready_r)
            self.ready_r = None

    def go(self, seen_dead_t: float) -> bool:
        """Tell a standby to take over; False when its pipe is gone (it died)."""
        if self.go_w is None:
            return False
        try:
            os.write(self.go_w, roles.GO + f" {seen_dead_t!r}\n".encode())
        except OSError:
            return False
        finally:
            with contextlib.suppress(OSError):
                os.close(self.go_w)
            self.go_w = None
        return True

    def close_pipes(self) -> None:
        for fd in (self.go_w, self.stepped_r):
            if fd is not None:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self.go_w = self.stepped_r = None
        self._close_ready()


@dataclass
class RankSet:
    """The ``nproc`` ranks of one generation of the job (active, or its standby)."""

    generation: int
    standby: bool
    port: int | None
    members: list[Member] = field(default_factory=list)
    started_t: float = field(default_factory=time.time)
    active_t: float = field(default_factory=time.time)  # started as, or promoted to, the job

    @property
    def pids(self) -> list[int]:
        return [m.proc.pid for m in self.members]

    def codes(self) -> list[int | None]:
        return [m.poll() for m in self.members]

    def ready(self) -> bool:
        return all(m.check_ready() for m in self.members)

    def stepped(self) -> bool:
        """Every member said it reached its first step."""
        return all([m.check_stepped() for m in self.members])

    def signal(self, sig: int) -> None:
        for m in self.members:
            if m.poll() is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(m.proc.pid, sig)

    def end(self, timeout_s: float = 10.0) -> None:
        """SIGKILL every member's process group and reap it."""
        self.signal(signal.SIGKILL)
        for m in self.members:
            with contextlib.suppress(subprocess.TimeoutExpired):
                m.proc.wait(timeout=timeout_s)
            m.close_pipes()
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(m.proc.pid, signal.SIGKILL)  # what the member left in its group

    def go(self, seen_dead_t: float) -> bool:
        """Promote a standby set: every member gets the go line (False: one could not) and
        normal CPU priority at once (one still building the model must not do it at idle
        priority now that it is the job; the standby also restores it itself, see wait.py)."""
        sent = [m.go(seen_dead_t) for m in self.members]
        for m in self.members:
            normal_priority(m.proc.pid)
        for m in self.members:
            m._close_ready()
        self.standby = False
        self.active_t = time.time()
        return all(sent)


def start_set(
    cmd: Sequence[str],
    *,
    generation: int,
    nproc: int,
    standby: bool,
    env: Mapping[str, str] | None = None,
) -> RankSet:
    """Start ``nproc`` copies of ``cmd`` (ranks 0..nproc-1; torchrun's variables when nproc > 1,
    on a fresh rendezvous port). A member that cannot be started ends the ones that were."""
    port = free_port() if nproc > 1 else None
    rs = RankSet(generation=generation, standby=standby, port=port)
    base = dict(os.environ if env is None else env)
    for name in roles.LAUNCHER:
        base.pop(name, None)
    base["FLASHCKPT_RUN_GENERATION"] = str(generation)
    try:
        for rank in range(nproc):
            rs.members.append(_start_member(cmd, rank, nproc, port, standby, base))
    except BaseException:
        rs.end()
        raise
    return rs


def _start_member(
    cmd: Sequence[str], rank: int, nproc: int, port: int | None, standby: bool, base: dict[str, str]
) -> Member:
    env = dict(base)
    if nproc > 1:
        env.update(
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(nproc),
            LOCAL_WORLD_SIZE=str(nproc),
            GROUP_RANK="0",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
        )
    stepped_r, stepped_w = os.pipe()
    os.set_blocking(stepped_r, False)
    env[roles.ENV_STEPPED_FD] = str(stepped_w)
    ours, theirs = [stepped_r], [stepped_w]  # parent's ends, child's ends
    low = None  # the standby's scheduling policy
    if standby:
        go_r, go_w = os.pipe()
        ready_r, ready_w = os.pipe()
        os.set_blocking(ready_r, False)
        ours += [go_w, ready_r]
        theirs += [go_r, ready_w]
        low = lowest_undoable_policy()
        lock = "writer" if nproc == 1 else f"rank-{rank}"
        env.update(
            roles.standby_env(fd=go_r, ready_fd=ready_w, lock_name=lock, idle=low is not None)
        )
    try:
        proc = subprocess.Popen(
            list(cmd),
            env=env,
            pass_fds=tuple(theirs),
            preexec_fn=_own_group_low(low) if low is not None else _own_group,
        )
    except BaseException:
        for fd in ours:
            os.close(fd)
        raise
    finally:
        for fd in theirs:
            os.close(fd)
    if not standby:
        return Member(proc=proc, rank=rank, stepped_r=stepped_r)
    return Member(proc=proc, rank=rank, go_w=go_w, ready_r=ready_r, stepped_r=stepped_r)
