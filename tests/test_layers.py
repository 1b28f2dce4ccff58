"""The layers stay honest (STYLE.md, DESIGN.md "Layout"), checked on the source itself:

* layers only import downward, in the order of ``LEVEL`` below: the bottom (errors, units,
  policy, memory), then store's file gateway, its on-disk format, state and the store itself;
  engine's stages in the order a checkpoint lives them (``engine.tiers`` -> ``engine.save`` /
  ``engine.restore`` -> ``distributed`` -> ``engine.runtime``), then integrations and demo, and
  ``cli`` on top; library code never imports ``cli``;
* only ``engine/`` and ``distributed/`` start threads or processes (``cli`` and ``demo`` are the
  programs on top: the benchmarks and the demo run child processes); only ``distributed/`` runs
  torch.distributed collectives;
* no import cycles, counting every import: module level, inside functions, and under
  ``if TYPE_CHECKING:`` (a cycle of annotations is still two modules that each think they own
  the other);
* no folder holds more than 16 modules.

Imports under ``if TYPE_CHECKING:`` do not count as upward imports (they are not imports at run
time). Each check also runs on a small tree made to break it, so a check that cannot fail would
show.
"""

from __future__ import annotations

import ast
import textwrap
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "flashckpt"
# module prefix -> level; the longest prefix that matches decides (flashckpt.engine.save.job:
# "engine.save"). A module may import only modules of its own level or below.
LEVEL: dict[str, float] = {
    "": 0,  # flashckpt/__init__.py, errors.py, units.py, version.py, dist.py (lazy alias)
    "policy": 0.5,
    "memory": 0.5,
    "store.files": 1,  # the file gateway and the backends
    "journal": 1.5,  # writes through the gateway
    "store.format": 2,  # what rests on disk
    "state": 2.5,  # flattening a state tree, and back (uses the format's dtypes)
    "store": 3,  # the checkpoint store and chunk liveness
    "engine": 4,  # engine/options.py, engine/device.py
    "engine.tiers": 4,
    "engine.save": 5,
    "engine.restore": 5,
    "distributed.group": 6,
    "distributed.replication": 6.5,
    "distributed": 7,
    "engine.runtime": 8,
    "report": 8,
    "integrations": 9,
    "demo": 9,
    "cli": 10,
    "__main__": 10,  # ``python -m flashckpt``: the program entry point, beside cli
}
SPAWNS = {"Thread", "ThreadPoolExecutor", "ProcessPoolExecutor", "Popen", "Process", "fork"}
SPAWNING = {"engine", "distributed", "cli", "demo"}
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
    """The ``LEVEL`` key of ``module``: its longest matching prefix below ``flashckpt.``."""
    parts = module.split(".")[1:]
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in LEVEL:
            return ".".join(parts[:n])
    return ""


def top(module: str) -> str:
    """The top-level package of ``module`` (``engine``, ``distributed``, ...), "" for top-level
    modules."""
    return layer(module).split(".")[0]


MODULE, FUNCTION, TYPING = "at module level", "in a function", "under TYPE_CHECKING"


def imports(path: Path, known: dict[str, Path]) -> list[tuple[str, str]]:
    """(imported module, where) for every import of ``path``; ``where`` is MODULE, FUNCTION or
    TYPING (inside ``if TYPE_CHECKING:``, not an import at run time)."""
    found: list[tuple[str, str]] = []

    def visit(nodes: list[ast.stmt] | list[ast.AST], where: str) -> None:
        for node in nodes:
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                visit(node.body, TYPING)
                visit(node.orelse, where)
                continue
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                visit(list(ast.iter_child_nodes(node)), FUNCTION if where == MODULE else where)
                continue
            if isinstance(node, ast.Import):
                found.extend((a.name, where) for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for a in node.names:  # ``from pkg import mod`` imports the module pkg.mod
                    sub = f"{node.module}.{a.name}"
                    found.append((sub if sub in known else node.module, where))
            visit(list(ast.iter_child_nodes(node)), where)

    visit([ast.parse(path.read_text())], MODULE)
    return found


def _calls(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    return [ast.unparse(n.func) for n in ast.walk(tree) if isinstance(n, ast.Call)]


def upward_imports(mods: dict[str, Path]) -> list[str]:
    bad = []
    for m, path in mods.items():
        for imp, where in imports(path, mods):
            if where == TYPING or not imp.startswith("flashckpt."):
                continue
            if LEVEL[layer(imp)] > LEVEL[layer(m)]:
                bad.append(f"{m} ({layer(m) or 'top'}) imports {imp} {where}")
    return bad


def spawns(mods: dict[str, Path]) -> list[str]:
    bad = []
    for m, path in mods.items():
        if top(m) in SPAWNING:
            continue
        for c in _calls(path):
            if c.split(".")[-1] in SPAWNS or c.startswith("subprocess."):
                bad.append(f"{m} calls {c}")
    return bad


def collectives(mods: dict[str, Path]) -> list[str]:
    bad = []
    for m, path in mods.items():
        if top(m) == "distributed":
            continue
        for c in _calls(path):
            head, _, name = c.rpartition(".")
            if name in COLLECTIVES and head.split(".")[0] in {"dist", "torch"}:
                bad.append(f"{m} calls {c}")
    return bad


def find_cycle(mods: dict[str, Path]) -> list[str] | None:
    """The first import cycle found, counting every import (module level, in functions and
    under TYPE_CHECKING), as [a, b, ..., a]; None when there is none."""
    graph = {
        m: sorted({i for i, _ in imports(p, mods) if i in mods and i != m}) for m, p in mods.items()
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


def crowded(src: Path, limit: int = 16) -> list[str]:
    """Folders of the package holding more than ``limit`` modules (``__init__`` not counted)."""
    bad = []
    for d in sorted(p for p in [src, *src.rglob("*")] if p.is_dir() and p.name != "__pycache__"):
        n = len([f for f in d.glob("*.py") if f.name != "__init__.py"])
        if n > limit:
            bad.append(f"{d.relative_to(src.parent)}: {n} modules")
    return bad


MODULES = modules(SRC)


def test_the_walk_sees_the_whole_package() -> None:
    assert {
        "flashckpt.engine.runtime.checkpointer",
        "flashckpt.store.store",
        "flashckpt.cli",
    } <= set(MODULES)
    assert {layer(m) for m in MODULES} <= set(LEVEL), "a new top-level package needs a level"
    job = imports(MODULES["flashckpt.engine.save.job"], MODULES)
    assert ("flashckpt.store.format.manifest", MODULE) in job
    assert ("flashckpt.engine.tiers.build", TYPING) in job


def test_imports_go_downward_only() -> None:
    assert upward_imports(MODULES) == []


def test_only_engine_and_distributed_start_threads_or_processes() -> None:
    assert spawns(MODULES) == []


def test_only_distributed_runs_collectives() -> None:
    assert collectives(MODULES) == []


def test_no_import_cycles() -> None:
    assert find_cycle(MODULES) is None


def test_no_folder_over_16_modules() -> None:
    assert crowded(SRC) == []


def test_engine_reads_as_the_pipeline() -> None:
    engine = SRC / "engine"
    stages = sorted(p.name for p in engine.iterdir() if (p / "__init__.py").exists())
    assert stages == ["restore", "runtime", "save", "tiers"]
    for stage in stages:  # each stage says what it owns and what it may call
        doc = ast.get_docstring(ast.parse((engine / stage / "__init__.py").read_text())) or ""
        assert "Owns" in doc and "May call" in doc, stage


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
                    from flashckpt.cli import main  # not at run time: not upward
                def later():
                    from flashckpt.engine.save import job  # upward, in a function
                    threading.Thread(target=later).start()
            """,
            "store/b.py": "import flashckpt.store.a\n",  # a <-> b
            "policy/__init__.py": "",
            "policy/p.py": "import torch.distributed as dist\ndist.all_reduce(1)\n",
            "engine/__init__.py": "",
            "engine/save/__init__.py": "",
            "engine/save/job.py": "import subprocess\nsubprocess.run(['true'])\n",  # allowed here
            # the stages' order: tiers sit below save
            "engine/tiers/__init__.py": "",
            "engine/tiers/t.py": "from flashckpt.engine.save.job import x\n",
            "cli/__init__.py": "",
        },
    )
    assert upward_imports(mods) == [
        "flashckpt.engine.tiers.t (engine.tiers) imports flashckpt.engine.save.job at module level",
        "flashckpt.store.a (store) imports flashckpt.engine.save.job in a function",
    ]
    assert spawns(mods) == ["flashckpt.store.a calls threading.Thread"]
    assert collectives(mods) == ["flashckpt.policy.p calls dist.all_reduce"]
    assert find_cycle(mods) == ["flashckpt.store.a", "flashckpt.store.b", "flashckpt.store.a"]


def test_a_cycle_through_function_or_typing_imports_is_a_cycle(tmp_path: Path) -> None:
    mods = _tree(
        tmp_path,
        {
            "__init__.py": "",
            "engine/__init__.py": "",
            "engine/a.py": "def f():\n    from flashckpt.engine import b\n",
            "engine/b.py": """
                from typing import TYPE_CHECKING
                if TYPE_CHECKING:
                    from flashckpt.engine.a import f
            """,
            "engine/c.py": "from flashckpt.engine import a\n",  # no cycle through c
        },
    )
    assert find_cycle(mods) == ["flashckpt.engine.a", "flashckpt.engine.b", "flashckpt.engine.a"]


def test_a_crowded_folder_is_found(tmp_path: Path) -> None:
    files = {"__init__.py": "", "engine/__init__.py": ""}
    files |= {f"engine/m{i}.py": "" for i in range(17)}
    _tree(tmp_path, files)
    assert crowded(tmp_path / "flashckpt") == ["flashckpt/engine: 17 modules"]
    (tmp_path / "flashckpt" / "engine" / "m0.py").unlink()
    assert crowded(tmp_path / "flashckpt") == []
