"""A small training script for the warm-standby tests, run under ``flashckpt run``.

``python standby_worker.py OUT STEPS``: trains a small MLP with AdamW for STEPS steps (one
torch thread, deterministic batches), checkpointing every step to ``OUT/root`` with a memory
tier. Under ``--nproc-per-node N`` (RANK/WORLD_SIZE set) it first joins a gloo group.
Writes to ``OUT/events-<rank>.jsonl``: ``start`` (pid, standby or not), ``restored`` (step,
digest of the live state right after the restore, how often the model was moved to its device
before and after it), ``step``. ``OUT/digests/<rank>-<step>`` holds the digest of the state as
saved at that step. Flags (files in OUT): ``crash_first_step`` -> the next resumed process
raises in its first step (the file is removed); ``fail_standby`` -> a standby exits 3 at once
(and the active finishes only once the launcher counted three failed standbys); ``standin`` ->
saves go through the device-staging path with the CPU stand-in for CUDA of
tests/engine/save/test_device_standin.py; ``slow_standby`` -> a standby sleeps 3 s after its
``start`` event (a window in which it is started but not yet ready); ``pause_resumed`` -> a
resumed process sleeps up to 10 s before its first step, while the file is there. The first
active process waits after its first step until the launcher says its standby is ready (or
failed): the launcher starts a standby only after that step, and the tests kill once it is
ready.
"""

import hashlib
import json
import os
import sys
import time
from pathlib import Path

import torch

import flashckpt

out, steps = Path(sys.argv[1]), int(sys.argv[2])
standby = os.environ.get("FLASHCKPT_STANDBY") == "1"
rank = int(os.environ.get("RANK", "0"))
world = int(os.environ.get("WORLD_SIZE", "1"))
log = open(out / f"events-{rank}.jsonl", "a")  # noqa: SIM115


def event(name: str, **fields: object) -> None:
    log.write(json.dumps({"event": name, "pid": os.getpid(), "t": time.time(), **fields}) + "\n")
    log.flush()


def autogroup() -> str | None:
    """This process's scheduler group (``/autogroup-N``) where the kernel has autogroups."""
    try:
        return Path("/proc/self/autogroup").read_text().split()[0]
    except (OSError, IndexError):
        return None


event("start", standby=standby, policy=os.sched_getscheduler(0), sid=os.getsid(0),
      pgid=os.getpgid(0), autogroup=autogroup())  # fmt: skip
if standby and (out / "fail_standby").exists():
    sys.exit(3)
if standby and (out / "slow_standby").exists():
    time.sleep(3.0)
if (out / "standin").exists():  # the CPU stand-in for CUDA that the device-staging tests use
    import pytest

    sys.path.insert(0, str(Path(__file__).parents[2] / "engine" / "save"))
    from fake_device import FakeDevice

    # every CPU tensor counts as a cuda:0 tensor, as in tests/engine/save/test_device_standin.py
    FakeDevice(delay_s=0.0, default_device="cuda:0", pinnable=False).install(pytest.MonkeyPatch())
if world > 1:
    import torch.distributed as dist

    dist.init_process_group("gloo")
torch.set_num_threads(1)


class Net(torch.nn.Sequential):
    moves = 0

    def to(self, *args, **kwargs):  # counts the moves to the device
        Net.moves += 1
        return super().to(*args, **kwargs)


torch.manual_seed(0)  # replicated, as under DDP: every rank holds the same state
model = Net(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 64))
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
model = flashckpt.to_device(model, "cpu")
moves_before = Net.moves
state = {"model": model, "optim": opt}


def launcher() -> dict:
    try:
        return json.loads((out / "launcher.json").read_text())
    except (OSError, ValueError):
        return {}


def wait_for_the_standby() -> None:
    deadline = time.monotonic() + 100
    while time.monotonic() < deadline:
        st = launcher()
        if st.get("standby_ready") or st.get("standby_failures"):
            return
        time.sleep(0.02)


def digest() -> str:
    h = hashlib.sha256()
    for part in ("model", "optim"):
        sd = state[part].state_dict()
        tensors = (
            sd.items()
            if part == "model"
            else sorted(
                ((f"{k}.{n}", v) for k, s in sd["state"].items() for n, v in s.items()),
                key=lambda kv: kv[0],
            )
        )
        for name, t in tensors:
            h.update(name.encode())
            h.update(t.detach().cpu().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


ckpt = flashckpt.Checkpointer(
    out / "root", memory_tier=out / "shm", async_save=True, keep=3, keep_memory=2
)
start = ckpt.restore(state) or 0
event("restored", step=start, digest=digest(), moves_before=moves_before, moves_after=Net.moves,
      was_standby=standby, policy=os.sched_getscheduler(0))  # fmt: skip
(out / "digests").mkdir(exist_ok=True)
pause_until = time.monotonic() + 10
while start and (out / "pause_resumed").exists() and time.monotonic() < pause_until:
    time.sleep(0.01)
for step in range(start + 1, steps + 1):
    if start and (out / "crash_first_step").exists() and rank == 0:
        (out / "crash_first_step").unlink()
        event("crashing", step=step)
        raise RuntimeError("a crash in the first resumed step")
    g = torch.Generator().manual_seed(step)
    x = torch.randn(16, 64, generator=g)
    loss = (model(x) - x).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    (out / "digests" / f"{rank}-{step}").write_text(digest())
    ckpt.save(step, state)
    event("step", step=step)
    if step == 1 and start == 0:
        wait_for_the_standby()
    time.sleep(0.05)
if (out / "fail_standby").exists():  # finish only once the launcher gave up on standbys
    deadline = time.monotonic() + 100
    while time.monotonic() < deadline and launcher().get("standby_failures", 0) < 3:
        time.sleep(0.05)
ckpt.close()
from flashckpt.engine import device  # noqa: E402

event("done", step=steps, device_calls=getattr(device.OPS, "copies", 0))
