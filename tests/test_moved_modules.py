"""The one deprecation path for modules that moved into packages (speedtronic/_renamed.py)."""

from __future__ import annotations

import json
import subprocess
import sys

from speedtronic._renamed import MOVED_INTO_PACKAGE, MOVED_MODULES

_PROBE = r"""
import importlib, json, sys, warnings
from speedtronic._renamed import MOVED_MODULES
out = {}
for old, new in MOVED_MODULES.items():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mod = importlib.import_module(old)
    out[old] = {"same": mod is importlib.import_module(new), "name": mod.__name__,
                "spec": mod.__spec__.name,
                "warnings": [str(w.message) for w in caught
                             if issubclass(w.category, DeprecationWarning)]}
print(json.dumps(out))
"""


def test_every_moved_module_imports_under_its_old_name_with_one_warning():
    proc = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True,
                          check=True)
    seen = json.loads(proc.stdout)
    assert set(seen) == set(MOVED_MODULES)
    for old, new in MOVED_MODULES.items():
        row = seen[old]
        # the very same module object, its own name and spec left alone
        assert row["same"] and row["name"] == new and row["spec"] == new, (old, row)
        assert row["warnings"] == [f"{old} is now {new}"], (old, row)


def test_old_from_imports_and_monkeypatching_reach_the_new_module(monkeypatch):
    import importlib
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        old = importlib.import_module("speedtronic.runtime")
        from speedtronic.trainer import Trainer as OldTrainer
    from speedtronic.train import runtime
    from speedtronic.train.trainer import Trainer

    assert OldTrainer is Trainer
    monkeypatch.setattr(old, "train_from_config", "patched")
    assert runtime.train_from_config == "patched"


def test_old_module_names_that_became_packages_serve_their_attributes_with_a_warning():
    import importlib

    import pytest

    for package, target in MOVED_INTO_PACKAGE.items():
        pkg, mod = importlib.import_module(package), importlib.import_module(target)
        name = next(n for n in sorted(vars(mod)) if not n.startswith("_")
                    and callable(getattr(mod, n)) and getattr(getattr(mod, n), "__module__",
                                                               None) == target)
        with pytest.warns(DeprecationWarning, match=f"{package}.{name} is now {target}.{name}"):
            assert getattr(pkg, name) is getattr(mod, name)
        with pytest.raises(AttributeError):
            pkg.no_such_name  # noqa: B018


def test_new_names_import_without_any_warning():
    code = ("import warnings; warnings.simplefilter('error')\n"
            "import speedtronic\n"
            "from speedtronic.train import Trainer, train_from_config\n"
            "from speedtronic.kernels import ops\n"
            "from speedtronic.ooo.scheduler import OOOScheduler\n"
            "from speedtronic.cli import main, console_main\n")
    subprocess.run([sys.executable, "-c", code], check=True)
