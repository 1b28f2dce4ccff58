"""DCP's own side of the round trip, run with flashckpt made unimportable.

``python dcp_worker.py load|save CKPT_DIR OUT WORLD`` starts WORLD gloo ranks on CPU. ``load``:
the state a DCP user builds, ``dcp.load`` of CKPT_DIR, ``set_state_dict``; rank 0 writes what it
got to OUT. ``save``: one training step, ``dcp.save`` of that state into CKPT_DIR; rank 0 writes
the reference state to OUT. Model and optimizer are those of ``test_dcp_layout``.
"""

from __future__ import annotations

import os
import socket
import sys

sys.modules["flashckpt"] = None  # type: ignore[assignment]

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from torch.distributed.checkpoint.state_dict import (  # noqa: E402
    get_state_dict,
    set_state_dict,
)


def build() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(6, 5), torch.nn.BatchNorm1d(5), torch.nn.Linear(5, 3)
    )
    return model, torch.optim.AdamW(model.parameters(), lr=0.01, betas=(0.8, 0.9))


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    g = torch.Generator().manual_seed(1)
    model(torch.randn(8, 6, generator=g)).pow(2).sum().backward()
    opt.step()
    opt.zero_grad()


def flat(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, object]:
    msd, osd = get_state_dict(model, opt)
    out: dict[str, object] = {f"model.{k}": v for k, v in msd.items()}
    for fqn, per in osd["state"].items():
        out.update({f"optim.state.{fqn}.{k}": v for k, v in per.items()})
    out["lr"] = osd["param_groups"][0]["lr"]
    out["betas"] = list(osd["param_groups"][0]["betas"])
    return out


def worker(rank: int, mode: str, path: str, out: str, world: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        model, opt = build()
        if mode == "save":
            train_step(model, opt)
            msd, osd = get_state_dict(model, opt)
            dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
        else:
            msd, osd = get_state_dict(model, opt)  # fresh: what the user already builds
            sd = {"model": msd, "optim": osd}
            dcp.load(sd, checkpoint_id=path)
            set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        if rank == 0:
            torch.save(flat(model, opt), out)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def main() -> None:
    mode, path, out, world = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    try:
        import flashckpt  # noqa: F401

        raise SystemExit("flashckpt was importable")
    except ImportError:
        pass
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(worker, args=(mode, path, out, world, port), nprocs=world, join=True)


if __name__ == "__main__":
    main()
