"""The import layers (docs/design.md §2), checked on the source and in a fresh process.

Dependencies point one way: cli → operator → profiler → planner, runtime → planner,
and everything may use ``shardwise.names`` and ``shardwise.basics``. A module that
imports against the direction fails here with its path and the import. Inside the
operator its rooms point one way too (docs/architecture.md), and no two modules
anywhere import each other, even lazily or for type checking only.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: folder → the packages its modules must not import (at any depth, lazily or not).
REFUSED = {
    "planner": ("shardwise.profiler", "shardwise.operator", "shardwise.runtime", "shardwise.cli"),
    "profiler": ("shardwise.operator", "shardwise.runtime", "shardwise.cli"),
    "runtime": ("shardwise.operator", "shardwise.profiler", "shardwise.cli"),
    "operator": ("shardwise.cli",),
}


def module_imports(path: Path) -> set[str]:
    """A module's absolute imports, at any depth: ``import x.y`` and ``from x.y import
    z`` give x.y, and ``from x import y`` gives x.y too (how ``from shardwise import
    runtime`` would reach a package)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
    return names


def refused_imports(folder: Path, refused: tuple[str, ...]) -> dict[str, list[str]]:
    out = {}
    for path in sorted(folder.rglob("*.py")):
        bad = sorted(
            n for n in module_imports(path) if any(n == r or n.startswith(r + ".") for r in refused)
        )
        if bad:
            out[str(path.relative_to(folder.parent))] = bad
    return out


@pytest.mark.parametrize("folder", sorted(REFUSED))
def test_imports_point_one_way(folder: str) -> None:
    assert refused_imports(ROOT / folder, REFUSED[folder]) == {}


def test_the_check_sees_a_lazy_refused_import(tmp_path: Path) -> None:
    (tmp_path / "planner").mkdir()
    (tmp_path / "planner" / "m.py").write_text(
        "def f():\n    from shardwise import runtime\n    import shardwise.operator.kube\n"
    )
    assert refused_imports(tmp_path / "planner", REFUSED["planner"]) == {
        "planner/m.py": ["shardwise.operator.kube", "shardwise.runtime"]
    }


def test_the_operator_never_imports_torch_at_import_time() -> None:
    """The operator plans in a child process; its own process stays small (it serves
    many jobs) and starts fast. Every operator module and the ``shardwise operator``
    command, imported in a fresh interpreter, leave torch unloaded."""
    modules = sorted(m for m in source_modules(ROOT) if m.startswith("shardwise.operator."))
    code = (
        "import importlib, sys\n"
        f"for m in {modules!r} + ['shardwise.cli.operator']:\n"
        "    importlib.import_module(m)\n"
        "heavy = sorted(m for m in ('torch', 'torchrec', 'fbgemm_gpu') if m in sys.modules)\n"
        "print(','.join(heavy))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert out.stdout.strip() == "", f"imported at import time: {out.stdout.strip()}"


# --------------------------------------------------------------------------- cycles

#: Where each part of the package lives: ``shardwise.<folder>`` is the repository's
#: ``<folder>/`` (linked from ``src/shardwise``), everything else is in ``src/``.
LINKED = ("planner", "profiler", "runtime", "operator")


def source_modules(root: Path) -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its ``__init__``)."""
    places = [(root / "src" / "shardwise", "shardwise")]
    places += [(root / f, f"shardwise.{f}") for f in LINKED if (root / f).is_dir()]
    out: dict[str, Path] = {}
    for folder, prefix in places:
        for path in sorted(folder.rglob("*.py")):
            parts = path.relative_to(folder).with_suffix("").parts
            if parts[0] in LINKED and folder.name == "shardwise":
                continue  # the links themselves: walked from the repository's folders
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join((prefix, *parts))] = path
    return out


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Module → the package modules it imports, at any depth: inside functions and
    under ``TYPE_CHECKING`` too (a type-only cycle is still two concepts that cannot be
    read apart). An import of a name resolves to the deepest module it names."""

    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        deps = {resolve(n) for n in module_imports(path) if n.startswith("shardwise")}
        graph[name] = {d for d in deps if d is not None and d != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each
    sorted: every module in one can reach every other."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_module_imports_itself_back() -> None:
    graph = import_graph(source_modules(ROOT))
    assert len(graph) > 150, "the walk missed the package"
    assert cycles(graph) == []


def test_the_cycle_check_sees_lazy_and_type_only_cycles(tmp_path: Path) -> None:
    (tmp_path / "planner" / "comm").mkdir(parents=True)
    (tmp_path / "planner" / "comm" / "__init__.py").write_text("")
    (tmp_path / "planner" / "comm" / "a.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from shardwise.planner.comm.b import B\n"
    )
    (tmp_path / "planner" / "comm" / "b.py").write_text(
        "def f():\n    from shardwise.planner.comm import a\n"
    )
    (tmp_path / "planner" / "c.py").write_text("import shardwise.planner.comm.a\n")
    modules = source_modules(tmp_path)
    assert sorted(modules) == [
        "shardwise.planner.c",
        "shardwise.planner.comm",
        "shardwise.planner.comm.a",
        "shardwise.planner.comm.b",
    ]
    assert cycles(import_graph(modules)) == [
        ["shardwise.planner.comm.a", "shardwise.planner.comm.b"]
    ]


#: The operator's rooms in import order: a room may import the rooms before it and the
#: process's own modules at the top of ``operator/``, never a room after it.
OPERATOR_ROOMS = ("cluster", "models", "render", "decide", "loop", "pod")


def test_the_operator_rooms_point_one_way() -> None:
    rooms = sorted(p.name for p in (ROOT / "operator").iterdir() if (p / "__init__.py").exists())
    assert rooms == sorted(OPERATOR_ROOMS), "a new room: give it its place in OPERATOR_ROOMS"
    order = {room: i for i, room in enumerate(OPERATOR_ROOMS)}

    def room(module: str) -> str | None:
        parts = module.split(".")
        return parts[2] if len(parts) > 3 and parts[2] in order else None

    against = sorted(
        f"{m} imports {d}"
        for m, deps in import_graph(source_modules(ROOT)).items()
        for d in deps
        if (r := room(m)) is not None and (t := room(d)) is not None and order[t] > order[r]
    )
    assert against == []
