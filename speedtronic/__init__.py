"""Speedtronic: a PyTorch training engine with fused Muon / Muon+ / cautious optimizers.

Importing the package is cheap: heavy modules (torch-dependent trainer, optimizers, kernels)
are imported on first attribute access, so ``speedtronic validate`` works without touching torch.
"""

from __future__ import annotations

import importlib
from typing import Any

from .config import ConfigError, SpeedtronicConfig, load_config
from .errors import SpeedtronicError

__version__ = "2.1.0.dev0"

__all__ = ["ConfigError", "SpeedtronicConfig", "SpeedtronicError", "load_config", "__version__"]

_LAZY_SUBMODULES = {"ops", "optim", "models", "data", "trainer", "runtime", "kernels", "diloco",
                    "ooo", "shapes", "compare", "checkpoint", "metrics", "plot", "env"}


def __getattr__(name: str) -> Any:
    if name in _LAZY_SUBMODULES:
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'speedtronic' has no attribute {name!r}")
