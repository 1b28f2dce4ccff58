"""flashckpt <-> torchtitan 0.3.0's own CheckpointManager, OptimizersContainer (two param
groups with different hyperparameters) and LRSchedulersContainer, in one process.

torchtitan is no test dependency (its requirements pull wandb, datasets and an older fsspec that
conflicts with s3fs), so this check runs by hand, with torchtitan installed beside the venv::

    pip install --no-deps --target /tmp/titan torchtitan==0.3.0 tyro docstring_parser \
        typeguard spmd_types torch_checkpointing einops
    PYTHONPATH=/tmp/titan .venv/bin/python tests/distributed/titan_real_check.py

A: a step saved by examples/torchtitan_checkpointer.py, exported with ``flashckpt export
--format dcp``, loads with torchtitan's manager; B: a checkpoint torchtitan's manager saved
imports with ``flashckpt import --format dcp`` and resumes through the drop-in manager. Both
compare every tensor, the learning rates, the LR schedule, the train state and the data
position.
"""

import subprocess
import sys
import tempfile
from pathlib import Path

from torchtitan.components.checkpoint import CheckpointManager
from torchtitan.components.optimizer import OptimizersContainer
from torchtitan.components.optimizer.lr_scheduler import LRSchedulersContainer

sys.path.insert(0, str(Path(__file__).resolve().parent))
import titan_state as t


def build(seed):
    st = t.State(0, 1, seed=seed, fsdp=False)
    from torchtitan.components.optimizer.optimizer import ParamGroupConfig

    cfg = OptimizersContainer.Config(
        implementation="for-loop",
        param_groups=[
            ParamGroupConfig(
                pattern=r"norm",
                optimizer_name="AdamW",
                optimizer_kwargs={"lr": 0.01, "betas": (0.8, 0.9), "weight_decay": 0.0},
            ),
            ParamGroupConfig(
                pattern=r".*",
                optimizer_name="AdamW",
                optimizer_kwargs={"lr": 0.02, "betas": (0.8, 0.9)},
            ),
        ],
    )
    st.optimizers = OptimizersContainer(cfg, model_parts=[st.model])
    st.lr_schedulers = LRSchedulersContainer(st.optimizers, lambda s: min(1.0, (s + 1) / 4))
    return st


def real(st, base):
    return CheckpointManager(
        CheckpointManager.Config(
            enable=True, folder="checkpoint", interval=1, last_save_model_only=False
        ),
        dataloader=st.dataloader,
        model_parts=[st.model],
        optimizers=st.optimizers,
        lr_schedulers=st.lr_schedulers,
        states={"train_state": st.train_state},
        sd_adapter=None,
        base_folder=str(base),
    )


tmp = Path(tempfile.mkdtemp())
# A: flashckpt save -> export -> torchtitan's manager loads
st = build(0)
st.train(3)
m = st.manager(tmp / "flash")
m.save(3)
m.close()
want = st.snapshot()
out = tmp / "titan" / "checkpoint" / "step-3"
subprocess.run(
    [
        sys.executable,
        "-m",
        "flashckpt",
        "export",
        str(tmp / "flash" / "checkpoint"),
        str(out),
        "--format",
        "dcp",
    ],
    check=True,
)
fresh = build(9)
mgr = real(fresh, tmp / "titan")
assert mgr.load(step=3), "real manager did not load"
t.assert_same(fresh.snapshot(), want)
print("A ok: torchtitan's CheckpointManager loaded the flashckpt export")
# B: torchtitan's manager saves -> flashckpt import -> the drop-in manager resumes
st = build(1)
st.train(3)
mgr = real(st, tmp / "titan2")
mgr.save(3, last_step=True)
mgr.close()
want = st.snapshot()
src = tmp / "titan2" / "checkpoint" / "step-3"
r = subprocess.run(
    [
        sys.executable,
        "-m",
        "flashckpt",
        "import",
        str(src),
        str(tmp / "imp" / "checkpoint"),
        "--format",
        "dcp",
        "--step",
        "3",
    ],
    capture_output=True,
    text=True,
)
print(
    r.stdout.strip(),
    "| stderr lines:",
    len(r.stderr.strip().splitlines()) if r.stderr.strip() else 0,
)
assert r.returncode == 0, r.stderr
fresh = build(9)
m = fresh.manager(tmp / "imp")
assert m.load()
m.close()
t.assert_same(fresh.snapshot(), want)
print("B ok: a checkpoint of torchtitan's CheckpointManager imported and resumed")
