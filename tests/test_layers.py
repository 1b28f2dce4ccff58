"""The layers stay honest (STYLE.md, DESIGN.md "Layout"), checked on the source itself:

* layers only import downward: ``cli -> integrations/demo -> engine/dist/report -> store/state``,
  with ``memory``, ``policy`` and the top-level modules at the bottom; library code never
  imports ``cli``;
* only ``engine/`` and ``dist/`` start threads or processes (``cli`` and ``demo`` are the
  programs on top: the benchmarks and the demo run child processes); only ``dist/`` runs
  torch.distributed collectives;
* no import cycles among module-level imports.

Imports under ``if TYPE_CHECKING:`` are not imports at run time and are not counted. Each check
also runs on a small tree made to break it, so a check that cannot fail would show.
"""

from __future__ import annotations

import ast
import textwrap
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "flashckpt"
LEVEL = {
    "": 0,  # flashckpt/__init__.py, errors.py, journal.py, units.py
    "store": 0,
    "state": 0,
    "memory": 0,
    "policy": 0,
    "engine": 1,
    "dist": 1,
    "report": 1,
    "integrations": 2,
    "demo": 2,
    "cli": 3,
}
SPAWNS = {"Thread", "ThreadPoolExecutor", "ProcessPoolExecutor", "Popen", "Process", "fork"}
SPAWNING = {"engine", "dist", "cli", "demo"}
COLLECTIVES = {
    "all_reduce",
    "all_gather",
    "all_gather_object",
    "broadcast",
    "broadcast_object_list",
    "barrier",
    "monitored_barrier",
    "gather",
    "scatter",
    "reduce_scatter",
    "send",
    "recv",
    "isend",
    "irecv",
}


def modules(src: Path) -> dict[str, Path]:
    out = {}
    for f in sorted(src.rglob("*.py")):
        parts = f.relative_to(src.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    return out


def layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and parts[1] in LEVEL) else ""


def imports(path: Path, known: dict[str, Path]) -> list[tuple[str, bool]]:
    """(imported module, inside a function) for every run-time import of ``path``."""
    found: list[tuple[str, bool]] = []

    def visit(node: ast.AST, in_func: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                for sub in child.orelse:
                    visit(sub, in_func)
                continue
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                visit(child, True)
                continue
            if isinstance(child, ast.Import):
                found.extend((a.name, in_func) for a in child.names)
            elif isinstance(child, ast.ImportFrom) and child.module and child.level == 0:
                for a in child.names:  # ``from pkg import mod`` imports the module pkg.mod
                    sub = f"{child.module}.{a.name}"
                    found.append((sub if sub in known else child.module, in_func))
            visit(child, in_func)

    visit(ast.parse(path.read_text()), False)
    return found


def _calls(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    return [ast.unparse(n.func) for n in ast.walk(tree) if isinstance(n, ast.Call)]


def upward_imports(mods: dict[str, Path]) -> list[str]:
    bad = []
    for m, path in mods.items():
        for imp, in_func in imports(path, mods):
            if imp.startswith("flashckpt.") and LEVEL[layer(imp)] > LEVEL[layer(m)]:
                where = "in a function" if in_func else "at module level"
                bad.append(f"{m} ({layer(m) or 'top'}) imports {imp} {where}")
    return bad


def spawns(mods: dict[str, Path]) -> list[str]:
    bad = []
    for m, path in mods.items():
        if layer(m) in SPAWNING:
            continue
        for c in _calls(path):
            if c.split(".")[-1] in SPAWNS or c.startswith("subprocess."):
                bad.append(f"{m} calls {c}")
    return bad


def collectives(mods: dict[str, Path]) -> list[str]:
    bad = []
    for m, path in mods.items():
        if layer(m) == "dist":
            continue
        for c in _calls(path):
            head, _, name = c.rpartition(".")
            if name in COLLECTIVES and head.split(".")[0] in {"dist", "torch"}:
                bad.append(f"{m} calls {c}")
    return bad


def find_cycle(mods: dict[str, Path]) -> list[str] | None:
    graph = {
        m: sorted({i for i, f in imports(p, mods) if not f and i in mods and i != m})
        for m, p in mods.items()
    }
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def walk(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for n in graph[m]:
            if state.get(n) == 1:
                return [*path[path.index(n) :], n]
            if n not in state and (cycle := walk(n)):
                return cycle
        path.pop()
        state[m] = 2
        return None

    for m in graph:
        if m not in state and (cycle := walk(m)):
            return cycle
    return None


MODULES = modules(SRC)


def test_the_walk_sees_the_whole_package() -> None:
    assert {"flashckpt.engine.checkpointer", "flashckpt.store.store", "flashckpt.cli"} <= set(
        MODULES
    )
    assert {layer(m) for m in MODULES} <= set(LEVEL), "a new top-level package needs a level"
    assert ("flashckpt.store.manifest", False) in imports(MODULES["flashckpt.engine.save"], MODULES)


def test_imports_go_downward_only() -> None:
    assert upward_imports(MODULES) == []


def test_only_engine_and_dist_start_threads_or_processes() -> None:
    assert spawns(MODULES) == []


def test_only_dist_runs_collectives() -> None:
    assert collectives(MODULES) == []


def test_no_import_cycles() -> None:
    assert find_cycle(MODULES) is None


def _tree(tmp_path: Path, files: dict[str, str]) -> dict[str, Path]:
    src = tmp_path / "flashckpt"
    for rel, text in files.items():
        p = src / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(textwrap.dedent(text))
    return modules(src)


def test_each_check_finds_what_it_is_for(tmp_path: Path) -> None:
    mods = _tree(
        tmp_path,
        {
            "__init__.py": "",
            "store/__init__.py": "",
            "store/a.py": """
                import threading
                from typing import TYPE_CHECKING
                from flashckpt.store import b
                if TYPE_CHECKING:
                    from flashckpt.cli import main  # not at run time: allowed
                def later():
                    from flashckpt.engine import save  # upward, in a function
                    threading.Thread(target=later).start()
            """,
            "store/b.py": "import flashckpt.store.a\n",  # a <-> b
            "policy/__init__.py": "",
            "policy/p.py": "import torch.distributed as dist\ndist.all_reduce(1)\n",
            "engine/__init__.py": "",
            "engine/save.py": "import subprocess\nsubprocess.run(['true'])\n",  # allowed here
            "cli/__init__.py": "",
        },
    )
    assert upward_imports(mods) == [
        "flashckpt.store.a (store) imports flashckpt.engine.save in a function"
    ]
    assert spawns(mods) == ["flashckpt.store.a calls threading.Thread"]
    assert collectives(mods) == ["flashckpt.policy.p calls dist.all_reduce"]
    assert find_cycle(mods) == ["flashckpt.store.a", "flashckpt.store.b", "flashckpt.store.a"]
