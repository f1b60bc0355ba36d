"""The layering of design.md: ``solvers`` imports without torch and never imports ``offremat``."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import solvers

SOLVERS_DIR = Path(solvers.__file__).parent

# Blocks torch with a meta-path finder, imports every module of solvers, and reports what it
# imported; exits non-zero if anything reached for torch.
_IMPORT_ALL_WITHOUT_TORCH = """
import importlib, pkgutil, sys

class BlockTorch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError(f"torch is blocked in this test (imported as {name})")
        return None

sys.meta_path.insert(0, BlockTorch())
import solvers
names = [f"solvers.{m.name}" for m in pkgutil.iter_modules(solvers.__path__)]
for name in names:
    importlib.import_module(name)
assert not [m for m in sys.modules if m == "torch" or m.startswith("torch.")]
print(" ".join(names))
"""


def test_every_solvers_module_imports_with_torch_blocked() -> None:
    result = subprocess.run(
        [sys.executable, "-c", _IMPORT_ALL_WITHOUT_TORCH],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    imported = set(result.stdout.split())
    expected = {f"solvers.{p.stem}" for p in SOLVERS_DIR.glob("*.py") if p.stem != "__init__"}
    assert imported == expected


def test_the_blocker_really_blocks_torch() -> None:
    # Guards the test above: the same finder must make a torch import fail.
    code = _IMPORT_ALL_WITHOUT_TORCH.split("import solvers")[0] + "import torch\n"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode != 0
    assert "torch is blocked" in result.stderr


def _imported_roots(path: Path) -> set[str]:
    roots = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            roots.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            roots.add(node.module.split(".")[0])
    return roots


def test_solvers_source_never_imports_torch_or_offremat() -> None:
    # Also catches imports inside functions, which the import test above would not execute.
    offenders = {
        path.name: sorted(_imported_roots(path) & {"torch", "offremat"})
        for path in sorted(SOLVERS_DIR.glob("*.py"))
    }
    assert {name: roots for name, roots in offenders.items() if roots} == {}


def _solvers_imports(path: Path) -> set[str]:
    """The solvers modules ``path`` imports, at the top or inside a function."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "solvers":
                names.update(f"solvers.{alias.name}" for alias in node.names)
            elif node.module.startswith("solvers."):
                names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names if a.name.startswith("solvers."))
    return names


def test_no_two_solvers_modules_import_each_other_even_indirectly() -> None:
    modules = {f"solvers.{p.stem}": p for p in SOLVERS_DIR.glob("*.py") if p.stem != "__init__"}
    graph = {name: _solvers_imports(path) & set(modules) for name, path in modules.items()}

    def reaches(start: str, goal: str) -> bool:
        seen, todo = set(), list(graph[start])
        while todo:
            name = todo.pop()
            if name == goal:
                return True
            if name not in seen:
                seen.add(name)
                todo += graph[name]
        return False

    assert sorted(name for name in modules if reaches(name, name)) == []
