"""Models: the registry (``register_model``, ``build_model``) and the reference transformer.

``build_model(cfg)`` builds ``cfg.model.name``; user models register with
``@register_model("name")`` or are named as ``"package.module:factory"`` in the config. A model
is called as ``model(input_ids, labels)`` and returns a loss; :func:`extract_loss` accepts a
tensor, ``{"loss": ...}`` or ``(loss, ...)``.
"""

from __future__ import annotations

from .loss import extract_loss
from .registry import BUILTIN_MODELS, ModelFactory, build_model, register_model, registered_models

__all__ = ["BUILTIN_MODELS", "ModelFactory", "ReferenceTransformer", "build_model", "extract_loss",
           "register_model", "registered_models"]


def __getattr__(name: str):
    if name == "ReferenceTransformer":
        from .reference import ReferenceTransformer

        return ReferenceTransformer
    raise AttributeError(f"module 'speedtronic.models' has no attribute {name!r}")
