"""Models: the registry (``register_model``, ``build_model``) and the reference transformer.

``build_model(cfg)`` builds ``cfg.model.name``; user models register with
``@register_model("name")`` or are named as ``"package.module:factory"`` in the config. A model
is called as ``model(input_ids, labels)`` and returns a loss; :func:`extract_loss` accepts a
tensor, ``{"loss": ...}`` or ``(loss, ...)``.
"""

from __future__ import annotations

from typing import Any

from .builtin import BUILTIN_MODELS

# The rest import torch: loaded on first use (PEP 562), so `from speedtronic.models import
# BUILTIN_MODELS` or `speedtronic.models.builtin` (validate) stay torch-free.
_LAZY = {"extract_loss": "loss", "ModelFactory": "registry", "build_model": "registry",
         "register_model": "registry", "registered_models": "registry",
         "ReferenceTransformer": "reference"}

__all__ = ["BUILTIN_MODELS", "ModelFactory", "ReferenceTransformer", "build_model", "extract_loss",
           "register_model", "registered_models"]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'speedtronic.models' has no attribute {name!r}")
