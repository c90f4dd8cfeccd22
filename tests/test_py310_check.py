""".ci/py310_check.py, the job that holds the code to README's Python 3.10 floor: it names a
3.11-only standard-library name, and the tree as it is passes."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _checker():
    spec = importlib.util.spec_from_file_location("py310_check", ROOT / ".ci" / "py310_check.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["py310_check"] = module
    spec.loader.exec_module(module)
    return module


def test_a_3_11_only_name_is_named_with_its_line(tmp_path, monkeypatch):
    check = _checker()
    planted = tmp_path / "examples" / "new.py"
    planted.parent.mkdir()
    planted.write_text("import json\nfrom datetime import UTC\nimport tomllib\n"
                       "def f(e):\n    return isinstance(e, ExceptionGroup)\n")
    monkeypatch.setattr(check, "ROOT", tmp_path)
    assert check._new_names(planted) == ["examples/new.py:2 datetime.UTC",
                                         "examples/new.py:3 tomllib",
                                         "examples/new.py:5 builtins.ExceptionGroup"]


def test_the_tree_uses_no_3_11_only_name():
    check = _checker()
    assert [hit for f in check._files() for hit in check._new_names(f)] == []
