"""Code that only a GPU runs still names attributes that exist.

The GPU check's benchmarks and the GPU-marked tests never execute on CPU CI, so a rename in the
package left them reading a name that was gone: ``bench_sym_gemm.py`` read
``newton_schulz._sym_state`` months after it became ``SYM_GEMM.disabled`` and would have crashed
on the first H200 run, after the timing. This reads every ``alias.name`` where ``alias`` is a
``speedtronic`` module imported by that file, and checks the module has ``name``.
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[1]
FILES = sorted([*ROOT.glob("benchmarks/*.py"), *ROOT.glob("examples/*.py"),
                *ROOT.glob("tests/**/*.py")])


def _module(name: str) -> ModuleType | None:
    try:
        return importlib.import_module(name)
    except ImportError:  # a name imported from a module, not a module (or an optional extra)
        return None


def _speedtronic_aliases(tree: ast.Module) -> dict[str, ModuleType]:
    """Local name -> module, for ``import speedtronic.x as a`` and ``from speedtronic.x import
    m [as a]`` where ``m`` is a module."""
    aliases: dict[str, ModuleType] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("speedtronic"):
            for a in node.names:
                mod = _module(f"{node.module}.{a.name}")
                if mod is not None:
                    aliases[a.asname or a.name] = mod
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("speedtronic") and a.asname:
                    mod = _module(a.name)
                    if mod is not None:
                        aliases[a.asname] = mod
    return aliases


def missing_attributes(source: str) -> list[str]:
    """``alias.name`` reads (not writes) of a speedtronic module alias whose module lacks name."""
    tree = ast.parse(source)
    aliases = _speedtronic_aliases(tree)
    return sorted({f"line {node.lineno}: {node.value.id}.{node.attr}"
                   for node in ast.walk(tree)
                   if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                   and node.value.id in aliases and not isinstance(node.ctx, ast.Store)
                   and not hasattr(aliases[node.value.id], node.attr)})


def test_the_check_finds_a_stale_name():
    source = ("from speedtronic.kernels import newton_schulz as ns\n"
              "x = ns._sym_state['disabled']\ny = ns.resolve_coefficients\n")
    assert missing_attributes(source) == ["line 2: ns._sym_state"]


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_module_attribute_read_exists(path: Path):
    assert missing_attributes(path.read_text()) == []
