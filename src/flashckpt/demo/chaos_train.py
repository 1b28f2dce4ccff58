"""One training process of the chaos benchmark: ``python -m flashckpt.demo.chaos_train CFG.json``.

Trains the demo GPT and checkpoints it with one method — ``flashckpt`` (memory tier + disk,
async, the ``Auto`` interval; ``flashckpt_standby`` is the same under ``flashckpt run --standby
1``, whose standby copy waits in ``restore()``), ``torch_save`` (``torch.save`` + fsync + rename) or
``dcp_async_save`` (``torch.distributed.checkpoint.async_save``) — resuming from that method's
newest complete checkpoint; ``none`` (the baseline: no checkpointing, ``CFG["steps"]`` steps,
no kills) measures the undisturbed step time and the cold start. The peers save at the
Young/Daly interval of their own measured cost: the same :class:`~flashckpt.policy.Auto`
policy, fed by the same :class:`~flashckpt.engine.runtime.meter.RunMeter` the Checkpointer uses (a
save costs its blocking plus what the steps lost while it persisted; until 2026-12-01 the peers
were fed their blocking time only, so ``dcp.async_save``, which blocks for milliseconds, saved
every few steps while its background writes slowed every step).

It appends one JSON line per event to ``CFG["log"]`` (``start`` with the process start, import,
restore and first-step times; then one ``step`` line per step with its compute and blocking
seconds and whether it saved), which :mod:`flashckpt.demo.chaos_stats` turns into goodput.
``t_proc`` is when the driver spawned the process (``FLASHCKPT_CHAOS_SPAWN_T``): restart time
includes the interpreter start and the imports. The chaos driver kills it with SIGKILL at
random instants; nothing here knows when.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import torch

import flashckpt
from flashckpt import Promotion
from flashckpt.demo.model import GPT, GPTConfig
from flashckpt.engine.runtime.meter import RunMeter
from flashckpt.engine.runtime.restart import process_start_time
from flashckpt.policy import Auto, KeepLast

T_IMPORTED = time.time()  # ``python -m`` imported torch and flashckpt before this line ran
VOCAB = 96


def spawn_time() -> float:
    """When the chaos driver started this process (it passes the time in the environment)."""
    try:
        return float(os.environ["FLASHCKPT_CHAOS_SPAWN_T"])
    except (KeyError, ValueError):
        return T_IMPORTED


class _Peer:
    """``torch_save`` / ``dcp_async_save``: files ``<root>/<step>`` plus a ``<step>.done``
    marker written only once the checkpoint is durable; restore takes the newest marked one."""

    def __init__(self, method: str, root: Path, state: dict[str, Any], mtbf_s: float) -> None:
        self.method, self.root, self.state = method, root, state
        self.root.mkdir(parents=True, exist_ok=True)
        self.policy = Auto(mtbf_s=mtbf_s)
        self.meter = RunMeter()
        self.last: tuple[int, float] | None = None
        self._pending: tuple[int, Any, float] | None = None
        self._blocking = 0.0  # what the async save in flight blocked

    def _sd(self) -> dict[str, Any]:
        return {
            "model": self.state["model"].state_dict(),
            "optim": self.state["optim"].state_dict(),
        }

    def restore(self) -> int:
        done = sorted(int(p.stem) for p in self.root.glob("*.done"))
        if not done:
            return 0
        step = done[-1]
        if self.method == "torch_save":
            sd = torch.load(self.root / f"{step}.pt", weights_only=True)
        else:
            import torch.distributed.checkpoint as dcp

            sd = self._sd()
            where = (self.root / f"{step}.done").read_text().strip() or str(step)
            dcp.load(sd, checkpoint_id=str(self.root / where), no_dist=True)
        self.state["model"].load_state_dict(sd["model"])
        self.state["optim"].load_state_dict(sd["optim"])
        self.last = (step, time.time())
        self.meter.saved(step, self.last[1], started=False)
        return step

    def should_save(self, step: int) -> bool:
        """Tick the meter (this step just ended), then ask the policy."""
        self._poll()
        now = time.time()
        self.meter.tick(step, now)
        return bool(self.policy.should_save(self.meter.stats(step, now))) or self.last is None

    def save(self, step: int) -> float:
        t0 = time.perf_counter()
        self.meter.saved(step, time.time())
        if self.method == "torch_save":
            tmp = self.root / f"{step}.pt.tmp"
            with open(tmp, "wb") as f:
                torch.save(self._sd(), f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.root / f"{step}.pt")
            self._mark(step)
            took = time.perf_counter() - t0
            self.meter.durable(blocking_s=took, background_s=took)
        else:
            import torch.distributed.checkpoint as dcp

            if self._pending is not None:
                self._pending[1].result()
                self._poll()
            # a directory of this process's own: a killed process may have left a partial
            # one for the same step (its async write was in flight)
            path = self.root / f"{step}-{os.getpid()}"
            writer = dcp.FileSystemWriter(str(path), sync_files=True)
            fut = dcp.async_save(self._sd(), storage_writer=writer, no_dist=True)
            self._pending = (step, fut, t0)
        cost = self._blocking = time.perf_counter() - t0  # (DCP: durable in _poll)
        self.last = (step, time.time())
        return cost

    def _poll(self) -> None:
        if self._pending is not None and self._pending[1].done():
            step, fut, t0 = self._pending
            fut.result()
            self._mark(step, f"{step}-{os.getpid()}")
            background = time.perf_counter() - t0
            self.meter.durable(blocking_s=self._blocking, background_s=background)
            self._pending = None

    def _mark(self, step: int, where: str = "") -> None:
        (self.root / f"{step}.done").write_text(where)  # the directory DCP wrote
        done = sorted(int(p.stem) for p in self.root.glob("*.done"))
        for old in done[:-2]:  # keep the last two complete checkpoints, delete the rest
            (self.root / f"{old}.done").unlink()
        keep = {f"{s}.pt" for s in done[-2:]}
        keep |= {(self.root / f"{s}.done").read_text() or str(s) for s in done[-2:]}
        for p in self.root.iterdir():  # older data, and what killed processes left
            if p.suffix != ".done" and p.name not in keep:
                shutil.rmtree(p) if p.is_dir() else p.unlink()

    def close(self) -> None:
        if self._pending is not None:
            self._pending[1].result()
            self._poll()


def build(cfg: dict[str, Any]) -> dict[str, Any]:
    torch.manual_seed(cfg["seed"])
    model = GPT(GPTConfig(vocab_size=VOCAB, dropout=0.0, **cfg["model"]))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return {"model": model, "optim": opt}


def batch(cfg: dict[str, Any], step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(cfg["seed"] * 1_000_003 + step)
    seq = torch.randint(0, VOCAB, (cfg["batch_size"], cfg["model"]["block_size"] + 1), generator=g)
    return seq[:, :-1], seq[:, 1:]


def train_step(cfg: dict[str, Any], state: dict[str, Any], step: int) -> float:
    x, y = batch(cfg, step)
    _, loss = state["model"](x, y)
    state["optim"].zero_grad(set_to_none=True)
    loss.backward()
    state["optim"].step()
    return float(loss.item())


def main(cfg_path: str) -> int:
    cfg = json.loads(Path(cfg_path).read_text())
    torch.set_num_threads(cfg["threads"])
    state = build(cfg)
    method, mtbf_s = cfg["method"], float(cfg["mtbf_s"])
    t_restore = time.time()
    ckpt: flashckpt.Checkpointer | None = None
    peer: _Peer | None = None
    standby = os.environ.get("FLASHCKPT_STANDBY") == "1"  # flashckpt run's standby copy
    if method in ("flashckpt", "flashckpt_standby"):
        ckpt = flashckpt.Checkpointer(
            cfg["root"],
            memory_tier=cfg["memory"],
            async_save=True,
            save_policy=Auto(mtbf_s=mtbf_s),
            keep=KeepLast(2),
            keep_memory=KeepLast(2),
            promotion=Promotion(every=int(cfg.get("promote_every", 1))),
        )
        start = ckpt.restore(state) or 0
    elif method == "none":
        start = 0
    else:
        peer = _Peer(method, Path(cfg["root"]), state, mtbf_s)
        start = peer.restore()
    log = open(cfg["log"], "a")  # noqa: SIM115 - the whole run
    t_proc = process_start_time()[0] if standby else spawn_time()
    start_rec = {"event": "start", "pid": os.getpid(), "step": start, "t_proc": t_proc}
    if standby:  # started before the kill it replaces: the stats time it from the kill
        start_rec["standby"] = True
    start_rec.update(t_imported=T_IMPORTED, t_restore=t_restore, t_restored=time.time())
    log.write("\n" + json.dumps(start_rec) + "\n")  # "\n" ends a line a killed process cut
    log.flush()
    for step in range(start + 1, cfg["steps"] + 1):
        t0 = time.perf_counter()
        train_step(cfg, state, step)
        compute = time.perf_counter() - t0
        blocked, saved = 0.0, False
        if ckpt is not None and ckpt.should_save(step):
            blocked, saved = ckpt.save(step, state).blocking_s, True
        elif peer is not None and peer.should_save(step):
            blocked, saved = peer.save(step), True
        rec = {"event": "step", "step": step, "t": time.time(), "compute_s": compute}
        rec.update(blocked_s=blocked, saved=saved)
        log.write(json.dumps(rec) + "\n")
        log.flush()
    if ckpt is not None:
        ckpt.close()
    if peer is not None:
        peer.close()
    log.write(json.dumps({"event": "done", "t": time.time()}) + "\n")
    log.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
