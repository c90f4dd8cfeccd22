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
    ("speedtronic.kernels.extension", "speedtronic"),
    # So is the loader of the torch-free CPU kernel library (models import it).
    ("speedtronic.kernels.cpu", "speedtronic"),
    # A model module never imports the registry; the registry names built-ins by string.
    ("speedtronic.models.reference", "speedtronic.models.registry"),
    # The contract is what back ends import; it imports none of them.
    ("speedtronic.diloco.store_contract", "speedtronic.diloco.store"),
    # The trainer runs what runtime built; it never reaches back into runtime.
    ("speedtronic.train.trainer", "speedtronic.train.runtime"),
    # The schema needs only the redaction helpers, never the loader; nor do its sections.
    ("speedtronic.config.schema", "speedtronic.config.loading"),
    ("speedtronic.config.model_data", "speedtronic.config.loading"),
    ("speedtronic.config.optimization", "speedtronic.config.loading"),
    ("speedtronic.config.lifecycle", "speedtronic.config.loading"),
])
def test_layering_seams(module, forbidden):
    graph = import_graph()
    bad = sorted(t for t in graph[module]
                 if t == forbidden or t.startswith(forbidden + ".")
                 or (forbidden == PACKAGE and t.startswith(PACKAGE)))
    assert not bad, f"{module} must not import {forbidden}: imports {bad}"


# ----------------------------------------------------------------------------- the layers
#: Each package's layer, lowest first. A module may import its own package, the package root
#: (``__version__``) and any package of a LOWER layer, never one of its own layer or above
#: (docs/architecture.md states the same table).
LAYERS: dict[str, int] = {
    "speedtronic.errors": 0, "speedtronic._renamed": 0, "speedtronic._process": 0,
    "speedtronic.config": 1, "speedtronic.kernels": 1,
    "speedtronic.models": 2, "speedtronic.data": 2, "speedtronic.optim": 2, "speedtronic.ooo": 2,
    "speedtronic.diloco": 3, "speedtronic.distributed": 3,
    "speedtronic.train": 4,
    "speedtronic.compare": 5,
    "speedtronic.cli": 6, "speedtronic.__main__": 7,
}


def _unit(module: str) -> str:
    """The layer unit a module belongs to: its top-level package (or top-level module)."""
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) > 1 else module


def layer_violations(graph: dict[str, set[str]], layers: dict[str, int]) -> list[str]:
    bad = []
    for mod, targets in sorted(graph.items()):
        if mod == PACKAGE:
            continue
        src = _unit(mod)
        for t in sorted(targets):
            dst = _unit(t)
            if t == PACKAGE or dst == src:
                continue
            if layers[dst] >= layers[src]:
                bad.append(f"{mod} (layer {layers[src]}) imports {t} (layer {layers[dst]})")
    return bad


def test_every_top_level_entry_has_a_layer():
    units = {_unit(m) for m in import_graph() if m != PACKAGE}
    assert units == set(LAYERS), (f"not in LAYERS: {sorted(units - set(LAYERS))}; "
                                  f"gone: {sorted(set(LAYERS) - units)}")


def test_no_package_imports_its_own_layer_or_a_higher_one():
    bad = layer_violations(import_graph(), LAYERS)
    assert not bad, "layer rule broken:\n  " + "\n  ".join(bad)


def test_the_layer_rule_catches_an_upward_import():
    graph = {"speedtronic.kernels.ops": {"speedtronic.train.trainer"},
             "speedtronic.train.trainer": {"speedtronic.kernels.ops", "speedtronic"},
             "speedtronic.optim.muon": {"speedtronic.data.build"}}
    assert layer_violations(graph, LAYERS) == [
        "speedtronic.kernels.ops (layer 1) imports speedtronic.train.trainer (layer 4)",
        "speedtronic.optim.muon (layer 2) imports speedtronic.data.build (layer 2)"]


def test_the_top_level_holds_only_packages_and_the_foundation():
    loose = sorted(p.name for p in PACKAGE_DIR.glob("*.py"))
    assert loose == ["__init__.py", "__main__.py", "_process.py", "_renamed.py", "errors.py"], \
        loose
    for pkg in sorted(p for p in PACKAGE_DIR.iterdir() if (p / "__init__.py").is_file()):
        doc = ast.get_docstring(ast.parse((pkg / "__init__.py").read_text()))
        assert doc and len(doc.splitlines()) >= 2, f"{pkg.name}/__init__.py: no layer docstring"
