"""Speedtronic: a PyTorch training engine with fused Muon / Muon+ / cautious optimizers.

Importing the package is cheap: heavy modules (torch-dependent trainer, optimizers, kernels)
are imported on first attribute access, so ``speedtronic validate`` works without touching torch.
"""

from __future__ import annotations

import importlib
from typing import Any

from . import _renamed
from .config import ConfigError, SpeedtronicConfig, load_config
from .errors import SpeedtronicError

__version__ = "2.1.0.dev0"

__all__ = ["ConfigError", "SpeedtronicConfig", "SpeedtronicError", "load_config", "__version__"]

#: The packages, bottom layer first (docs/architecture.md has the table and the rules).
_LAZY_SUBMODULES = {"kernels", "models", "data", "optim", "ooo", "diloco", "train", "compare",
                    "cli"}

_renamed.install_module_aliases()


def __getattr__(name: str) -> Any:
    if name in _LAZY_SUBMODULES or f"{__name__}.{name}" in _renamed.MOVED_MODULES:
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'speedtronic' has no attribute {name!r}")
