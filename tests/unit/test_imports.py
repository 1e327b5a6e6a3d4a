"""Imports run one way: cli / training -> server -> llm -> drafters / engine -> heads -> models -> kernels, with no
circles.

The graph is read from the source (every ``import``, lazy ones inside functions included), so a circle
that Python tolerates at run time because one side imports late still fails here.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"

# Each layer may import only from layers below it (and from the shared leaves).
LAYERS = [
    ("verispec.cli", "verispec.bench", "verispec.training"),
    ("verispec.server",),
    ("verispec.llm",),
    ("verispec.drafters", "verispec.engine"),
    ("verispec.heads",),
    ("verispec.models",),
    ("verispec.kernels",),
]


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(root: Path, package: str = "verispec") -> dict[str, set[str]]:
    """{module: modules of the package it imports}, for every .py file under root/package."""
    files = {module_name(p, root): p for p in (root / package).rglob("*.py")}
    graph: dict[str, set[str]] = {m: set() for m in files}
    for mod, path in files.items():
        pkg = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = pkg.split(".")[: len(pkg.split(".")) - node.level + 1] if node.level else []
                target = ".".join(base + ([node.module] if node.module else []))
                subs = [f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in files]
                extension = [a for a in node.names if a.name == "_C"]  # the compiled kernels, not the package
                targets = subs + ([target] if len(subs) + len(extension) < len(node.names) else [])
            else:
                continue
            graph[mod] |= {t for t in targets if t in files and t != mod}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def layer_of(module: str) -> int | None:
    for i, prefixes in enumerate(LAYERS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return i
    return None


def upward_imports(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    return [(a, b) for a, targets in graph.items() for b in targets
            if layer_of(a) is not None and layer_of(b) is not None and layer_of(b) < layer_of(a)]


def test_no_import_circles():
    assert circles(import_graph(SRC)) == []


def test_imports_run_down_the_layers():
    assert upward_imports(import_graph(SRC)) == []


def _write(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


@pytest.mark.parametrize("files", [
    {"verispec/__init__.py": "", "verispec/a.py": "def f():\n    from .b import g\n", "verispec/b.py": "from . import a\n"},
    {"verispec/__init__.py": "", "verispec/models/__init__.py": "",
     "verispec/config.py": "def f():\n    from .models.loader import auto_dtype\n",
     "verispec/models/loader.py": "from ..config import WEIGHTS\n"},
])
def test_a_circle_is_found(tmp_path, files):
    """Negative control: a planted circle (a lazy import on one side) is reported."""
    found = circles(import_graph(_write(tmp_path, files)))
    assert found and all(len(c) > 1 for c in found)


def test_an_upward_import_is_found(tmp_path):
    """Negative control: models importing from llm breaks the layering."""
    root = _write(tmp_path, {"verispec/__init__.py": "", "verispec/llm.py": "", "verispec/models/__init__.py": "",
                             "verispec/models/loader.py": "def f():\n    from ..llm import LLM\n"})
    assert upward_imports(import_graph(root)) == [("verispec.models.loader", "verispec.llm")]
