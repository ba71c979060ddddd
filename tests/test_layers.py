"""The import layers (docs/design.md §2), checked on the source and in a fresh process.

Dependencies point one way: cli → operator → profiler → planner, runtime → planner,
and everything may use ``shardwise.names`` and ``shardwise.basics``. A module that
imports against the direction fails here with its path and the import.
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
        "def f():\n    from shardwise import runtime\n    import shardwise.operator.render\n"
    )
    assert refused_imports(tmp_path / "planner", REFUSED["planner"]) == {
        "planner/m.py": ["shardwise.operator.render", "shardwise.runtime"]
    }


def test_the_operator_never_imports_torch_at_import_time() -> None:
    """The operator plans in a child process; its own process stays small (it serves
    many jobs) and starts fast. Every operator module and the ``shardwise operator``
    command, imported in a fresh interpreter, leave torch unloaded."""
    modules = sorted(f"shardwise.operator.{p.stem}" for p in (ROOT / "operator").glob("*.py"))
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
