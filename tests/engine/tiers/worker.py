"""A training process for the tier tests: ``python worker.py MODE ROOT MEM [REMOTE] [EMERGENCY]``.

Modes: ``kill`` (save to the memory tier, then SIGKILL itself before promotion), ``restore``
(restore the newest checkpoint, print its step and checksum as JSON, close), ``train`` (a loop
with ``handle_sigterm=True`` and slow writes, so a SIGTERM lands mid-save).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import torch

import flashckpt
from flashckpt.engine.tiers import promote
from flashckpt.store.files.backend import LocalBackend


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(600, 600), torch.nn.Linear(600, 8))


def bump(m: torch.nn.Module, step: int) -> None:
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.001 * (step + 1))


def checksum(m: torch.nn.Module) -> str:
    return repr(sum(float(p.double().sum()) for p in m.parameters()))


def main() -> int:
    mode, root, mem = sys.argv[1:4]
    remote = sys.argv[4] if len(sys.argv) > 4 and sys.argv[4] != "-" else None
    emergency = len(sys.argv) > 5 and sys.argv[5] == "emergency"
    m = model()
    if mode == "kill":
        promote.copy_step = lambda *a, **k: time.sleep(3600)  # type: ignore[assignment]
        ck = flashckpt.Checkpointer(root, memory_tier=mem)
        bump(m, 7)
        ck.save(7, {"m": m})
        print(json.dumps({"step": 7, "checksum": checksum(m)}), flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    if mode == "restore":
        ck = flashckpt.Checkpointer(root, memory_tier=mem, remote=remote)
        step = ck.restore({"m": m})
        ck.close()
        print(json.dumps({"step": step, "checksum": checksum(m)}), flush=True)
        return 0
    real_put = LocalBackend.put

    def slow_put(self: LocalBackend, path: str, parts: object) -> int:
        # the memory tier's writes are slow: its manifests too, since an uncompressed CPU
        # chunk is written by staging itself (engine/save/job.py _stage_direct) and save()
        # returns once staged: the commit is what is then still in flight
        if path.startswith(("chunks/", "steps/")) and str(self.root) == os.path.abspath(mem):
            time.sleep(0.25)
        return real_put(self, path, parts)  # type: ignore[arg-type]

    LocalBackend.put = slow_put  # type: ignore[method-assign]
    ck = flashckpt.Checkpointer(
        root,
        memory_tier=mem,
        remote=remote,
        async_save=True,
        chunk_size="256KiB",
        persist_workers=2,
        save_policy=5,
        handle_sigterm=True,
        grace_period_s=30,
        emergency_save=True if emergency else None,
        promotion=flashckpt.Promotion(every=int(os.environ.get("WORKER_PROMOTE_EVERY", "1"))),
    )
    state = {"m": m}
    for step in range(1, 400):
        bump(m, step)
        print(f"step {step} {checksum(m)}", flush=True)
        if ck.should_save(step):
            ck.save(step, state)
            print(f"saved {step}", flush=True)
        time.sleep(0.02)
    ck.close()
    print("finished", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
