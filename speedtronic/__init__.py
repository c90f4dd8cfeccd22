"""Speedtronic: a PyTorch training engine with fused Muon / Muon+ / cautious optimizers.

Importing the package is cheap: heavy modules (torch-dependent trainer, optimizers, kernels)
are imported on first attribute access, so ``speedtronic validate`` works without touching torch.
"""

from __future__ import annotations

import importlib
import warnings
from typing import Any

from . import _renamed
from .config import ConfigError, SpeedtronicConfig, load_config
from .errors import SpeedtronicError

__version__ = "2.1.0.dev0"

__all__ = ["AdamW", "ConfigError", "HybridOptimizer", "Muon", "SpeedtronicConfig",
           "SpeedtronicError", "Trainer", "build_optimizer", "load_config", "train_from_config",
           "__version__"]

#: The optimizers and the trainer, importable from the top (loaded on first use: torch).
_LAZY_NAMES = {"AdamW": "optim", "HybridOptimizer": "optim", "Muon": "optim",
               "build_optimizer": "optim", "Trainer": "train", "train_from_config": "train"}

#: The packages, bottom layer first (docs/architecture.md has the table and the rules).
_LAZY_SUBMODULES = {"kernels", "models", "data", "optim", "ooo", "diloco", "train", "compare",
                    "cli"}

_renamed.install_module_aliases()


def __getattr__(name: str) -> Any:
    if name in _LAZY_SUBMODULES or f"{__name__}.{name}" in _renamed.MOVED_MODULES:
        return importlib.import_module(f".{name}", __name__)
    if name in _LAZY_NAMES:
        return getattr(importlib.import_module(f".{_LAZY_NAMES[name]}", __name__), name)
    if name in _renamed.V2_TOP_LEVEL:  # speedtronic 2.0 exported these from the top
        module = _renamed.V2_TOP_LEVEL[name]
        warnings.warn(f"speedtronic.{name} is now {module}.{name}", DeprecationWarning,
                      stacklevel=2)
        return getattr(importlib.import_module(module), name)
    gone = _renamed.v2_gone_name(name)
    if gone is not None:
        raise gone
    raise AttributeError(f"module 'speedtronic' has no attribute {name!r}")
