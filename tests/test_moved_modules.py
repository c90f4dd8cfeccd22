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


# ---- speedtronic 2.0's names (docs/upgrading.md) ---------------------------------------------

def test_the_optimizers_and_trainer_import_from_the_top_without_a_warning(recwarn):
    from speedtronic import AdamW, HybridOptimizer, Muon, Trainer, build_optimizer
    from speedtronic.optim import build
    from speedtronic.train import trainer

    assert HybridOptimizer is build.HybridOptimizer and build_optimizer is build.build_optimizer
    assert Trainer is trainer.Trainer and Muon.__module__ == "speedtronic.optim.muon"
    assert AdamW.__module__ == "speedtronic.optim.adamw"
    assert not [w for w in recwarn if issubclass(w.category, DeprecationWarning)]


def test_2_0_top_level_names_are_served_with_a_warning_or_named_as_gone():
    import importlib
    import warnings

    import speedtronic
    from speedtronic._renamed import V2_GONE_NAMES, V2_TOP_LEVEL

    for name, module in V2_TOP_LEVEL.items():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            value = getattr(speedtronic, name)
        assert value is getattr(importlib.import_module(module), name), name
        assert [str(w.message) for w in caught] == [f"speedtronic.{name} is now {module}.{name}"]
    for name, advice in V2_GONE_NAMES.items():
        # `from speedtronic import X` keeps this text (an AttributeError would be replaced by a
        # bare "cannot import name")
        try:
            exec(f"from speedtronic import {name}", {})
        except ImportError as exc:
            assert str(exc).startswith(f"speedtronic.{name} was speedtronic 2.0's; now: ")
            assert advice in str(exc)
        else:
            raise AssertionError(f"{name} imported")
    assert not hasattr(speedtronic, "no_such_name")  # other names: a plain AttributeError


def test_2_0_modules_that_are_gone_say_where_their_contents_went():
    import importlib

    from speedtronic._renamed import V2_GONE_MODULES

    for old, where in V2_GONE_MODULES.items():
        try:
            importlib.import_module(old)
        except ModuleNotFoundError as exc:
            assert exc.name == old and where in str(exc) and "speedtronic 2.0" in str(exc), old
        else:
            raise AssertionError(f"{old} imported")
