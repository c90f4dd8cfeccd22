"""The package's import graph has no cycles, and the seams the layout promises hold.

The graph is read from the source (``ast``), not from ``sys.modules``: every ``import`` and
``from ... import`` counts wherever it appears (module level, inside a function, under
``TYPE_CHECKING``), and so does ``importlib.import_module("speedtronic....")`` with a literal
name. A lazy import inside a function still ties two modules together; it only hides the cycle
from the interpreter until the wrong call order runs.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE_DIR = Path(__file__).resolve().parent.parent / "speedtronic"
PACKAGE = "speedtronic"


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The module that ``name`` lives in (``a.b.c`` -> ``a.b`` when ``c`` is an attribute)."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _imported_names(tree: ast.AST, package: str) -> list[str]:
    names: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([node.module] if node.module else []))
            # ``from pkg import sub`` imports the submodule ``pkg.sub`` when it is one.
            names.extend(f"{base}.{alias.name}" for alias in node.names)
        elif (isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "import_module"
              and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str)):
            names.append(node.args[0].value)
    return names


def import_graph() -> dict[str, set[str]]:
    """``module -> modules of this package it imports`` (self-edges dropped)."""
    modules = _modules()
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for mod, path in modules.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for name in _imported_names(ast.parse(path.read_text(), str(path)), package):
            if name == PACKAGE or name.startswith(PACKAGE + "."):
                target = _resolve(name, modules)
                if target and target != mod:
                    graph[mod].add(target)
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

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
                cycles.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def test_the_package_has_no_import_cycles():
    graph = import_graph()
    cycles = find_cycles(graph)
    detail = ["  " + " <-> ".join(c) + ": " + "; ".join(
        f"{a} imports {b}" for a in c for b in sorted(graph[a]) if b in c) for c in cycles]
    assert not cycles, "import cycles:\n" + "\n".join(detail)


def test_the_cycle_finder_finds_a_planted_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert find_cycles(graph) == [["a", "b", "c"]]
    assert find_cycles({"a": {"b"}, "b": set()}) == []


def test_lazy_and_string_imports_are_edges(tmp_path):
    code = ("def f():\n    from .b import x\n"
            "import importlib\nimportlib.import_module('speedtronic.c')\n")
    names = _imported_names(ast.parse(code), "speedtronic")
    assert "speedtronic.b.x" in names and "speedtronic.c" in names


@pytest.mark.parametrize("module, forbidden", [
    # The loader of the compiled extension is a leaf: ops hands it the op list.
    ("speedtronic.kernels", "speedtronic"),
    # So is the loader of the torch-free CPU kernel library (models import it).
    ("speedtronic.cpu_kernels", "speedtronic"),
    # A model module never imports the registry; the registry names built-ins by string.
    ("speedtronic.models.reference", "speedtronic.models.registry"),
    # The contract is what back ends import; it imports none of them.
    ("speedtronic.diloco.store_contract", "speedtronic.diloco.store"),
    # The trainer runs what runtime built; it never reaches back into runtime.
    ("speedtronic.trainer", "speedtronic.runtime"),
    # The schema needs only the redaction helpers, never the loader.
    ("speedtronic.config.schema", "speedtronic.config.loading"),
])
def test_layering_seams(module, forbidden):
    graph = import_graph()
    bad = sorted(t for t in graph[module]
                 if t == forbidden or t.startswith(forbidden + ".")
                 or (forbidden == PACKAGE and t.startswith(PACKAGE)))
    assert not bad, f"{module} must not import {forbidden}: imports {bad}"
