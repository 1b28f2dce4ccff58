"""Run representative scenarios under ``sys.addaudithook`` and print, as JSON, every file event
on a watched path (a root, a tier, a memory tier) raised while no gateway function
(``flashckpt.store.files.safeopen``) was running. Run by tests/hostile/test_gateway_audit.py in
a subprocess: an audit hook cannot be removed once added.

Events with a path relative to a directory fd (``os.open(name, dir_fd=...)``) carry no absolute
path: they can only be made from a directory fd, which only the gateway hands out under a root.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Any

EVENTS = {
    "open",
    "os.rename",
    "os.remove",
    "os.mkdir",
    "os.rmdir",
    "os.link",
    "os.symlink",
    "os.chmod",
    "os.chown",
    "os.truncate",
    "os.utime",
    "os.listdir",
    "os.scandir",
    "shutil.rmtree",
    "shutil.copyfile",
    "shutil.move",
}
WATCHED: list[str] = []
VIOLATIONS: list[dict[str, Any]] = []
THROUGH_GATEWAY: dict[str, int] = {}  # watched events per scenario raised inside the gateway
SCENARIO = ["setup"]
_busy = [False]


def _paths(event: str, args: tuple[Any, ...]) -> list[str]:
    out = []
    n = (
        2
        if event in ("os.rename", "os.link", "os.symlink", "shutil.copyfile", "shutil.move")
        else 1
    )
    for a in args[:n]:
        if isinstance(a, (str, bytes, os.PathLike)):
            p = os.fsdecode(a)
            if os.path.isabs(p):
                out.append(os.path.normpath(p))
    return out


def hook(event: str, args: tuple[Any, ...]) -> None:
    if event not in EVENTS or _busy[0] or not WATCHED:
        return
    from flashckpt.store.files import safeopen

    inside = safeopen.in_gateway()
    for p in _paths(event, args):
        if any(p == w or p.startswith(w + os.sep) for w in WATCHED):
            if inside:
                THROUGH_GATEWAY[SCENARIO[0]] = THROUGH_GATEWAY.get(SCENARIO[0], 0) + 1
                return
            _busy[0] = True
            try:
                stack = [
                    f"{f.filename.split('/src/')[-1]}:{f.lineno} {f.name}"
                    for f in traceback.extract_stack()[:-1]
                    if "/flashckpt/" in f.filename
                ]
                VIOLATIONS.append(
                    {"scenario": SCENARIO[0], "event": event, "path": p, "stack": stack[-4:]}
                )
            finally:
                _busy[0] = False
            return


def scenarios(base: Path) -> None:
    import torch

    import flashckpt
    from flashckpt.cli import main
    from flashckpt.store.files.backend import LocalBackend
    from flashckpt.store.gc import collect_garbage
    from flashckpt.store.store import CheckpointStore

    root, mem, imp = base / "root", base / "shm" / "run", base / "import-out"
    out = base / "exports"
    out.mkdir()
    WATCHED.extend(str(p) for p in (root, mem, base / "shm", imp))
    model = torch.nn.Linear(8, 8)

    def state(v: float) -> dict[str, Any]:
        with torch.no_grad():
            model.weight.fill_(v)
        return {"model": model, "meta": {"v": v}}

    SCENARIO[0] = "save+promote+retention"
    with flashckpt.Checkpointer(root, memory_tier=mem, keep=2, keep_memory=2) as ckpt:
        for step in range(1, 5):
            ckpt.save(step, state(float(step)))
        ckpt.wait()
        ckpt.wait_promoted(timeout_s=60)
    SCENARIO[0] = "restore"
    with flashckpt.Checkpointer(root, memory_tier=mem) as ckpt:
        ckpt.restore(state(0.0))
    SCENARIO[0] = "read-only restore"
    flashckpt.restore(root, state(0.0))
    SCENARIO[0] = "gc"
    collect_garbage(CheckpointStore(LocalBackend(root)))
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        for argv in (
            ["ls", str(root)],
            ["inspect", str(root)],
            ["status", str(root)],
            ["status", str(root), "--json"],
            ["report", str(root), "-o", str(out / "r.html")],
            ["gc", str(root)],
            ["export", str(root), str(out / "m.safetensors")],
            ["export", str(root), str(out / "m.pt"), "--format", "torch"],
            ["export", str(root), str(out / "dcp"), "--format", "dcp"],
            ["import", str(out / "m.safetensors"), str(imp)],
            ["diff", str(root), "3", "4"],
        ):
            SCENARIO[0] = "cli " + " ".join(argv[:1] + argv[2:3])
            rc = main(argv)
            assert rc == 0, (argv, rc)
    SCENARIO[0] = "quarantine"
    _busy[0] = True
    chunk = next(p for p in sorted((root / "chunks").rglob("*")) if p.is_file())
    chunk.write_bytes(b"\xff" * chunk.stat().st_size)  # the test's own damage
    _busy[0] = False
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        SCENARIO[0] = "cli verify"
        assert main(["verify", str(root)]) == 1  # the damage is found
    SCENARIO[0] = "restore after damage"
    with flashckpt.Checkpointer(root, memory_tier=mem) as ckpt:
        ckpt.restore(state(0.0))
    SCENARIO[0] = "canary"  # a raw open under the root: the hook must report it
    with open(root / "canary.txt", "w") as f:
        f.write("raw")


def main() -> None:
    with tempfile.TemporaryDirectory() as d:
        base = Path(d)
        sys.addaudithook(hook)
        error = None
        try:
            scenarios(base)
        except Exception as exc:  # reported, so the test shows it
            error = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"
        WATCHED.clear()
    print(json.dumps({"violations": VIOLATIONS, "through": THROUGH_GATEWAY, "error": error}))


if __name__ == "__main__":
    main()
