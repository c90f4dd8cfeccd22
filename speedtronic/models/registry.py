"""Model registry: names -> factories ``factory(cfg: ModelConfig) -> nn.Module``.

Built-in models are listed below by import string and imported on first use, so a model module
never imports the registry (no cycle) and ``speedtronic validate`` stays free of torch models.
A name registered with :func:`register_model` wins over a built-in of the same name. Besides
registered names, ``model.name`` may be an import string ``"package.module:factory"``,
so a YAML-only CLI run can use a user model without any Python glue (the v2 engine could not:
its registry was process-local only).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, TypeVar

from torch import nn

from ..config import ConfigError, ModelConfig, SpeedtronicConfig
from ..errors import SpeedtronicError, check_factory_call, import_factory
from .builtin import BUILTIN_MODELS, unknown_model_error
from .hf import adapt_model
from .loss import extract_loss

__all__ = ["register_model", "build_model", "registered_models", "extract_loss", "ModelFactory",
           "BUILTIN_MODELS"]

logger = logging.getLogger("speedtronic.models")

ModelFactory = Callable[[ModelConfig], nn.Module]
F = TypeVar("F", bound=ModelFactory)

_REGISTRY: dict[str, ModelFactory] = {}

def register_model(name: str, factory: F | None = None) -> Any:
    """Register ``factory`` under ``name``; usable as ``@register_model("name")`` or directly.

    Re-registering a name replaces the old factory (with a log line), so notebooks can iterate.
    """
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"model name must be a non-empty string, got {name!r}")

    def decorator(fn: F) -> F:
        if not callable(fn):
            raise TypeError(f"model factory for {name!r} must be callable, got {fn!r}")
        if name in _REGISTRY and _REGISTRY[name] is not fn:
            logger.info("model registry: %r re-registered (replacing the previous factory)", name)
        _REGISTRY[name] = fn
        return fn

    return decorator(factory) if factory is not None else decorator


def registered_models() -> list[str]:
    """Sorted names of all registered models (built-ins included)."""
    return sorted(set(_REGISTRY) | set(BUILTIN_MODELS))


def _import_factory(spec: str) -> ModelFactory:
    return import_factory(spec, "model.name")  # type: ignore[return-value]


def build_model(cfg: SpeedtronicConfig | ModelConfig) -> nn.Module:
    """Build the model named by ``cfg.model.name`` (or ``cfg.name`` for a bare ModelConfig).

    Applies ``model.gradient_checkpointing`` through ``set_gradient_checkpointing`` and raises
    :class:`ConfigError` for an unknown name, listing the registered ones.
    """
    model_cfg: ModelConfig = cfg.model if hasattr(cfg, "model") else cfg
    name = model_cfg.name
    if name in _REGISTRY:
        factory = _REGISTRY[name]
    elif name in BUILTIN_MODELS:
        factory = _import_factory(BUILTIN_MODELS[name])
    elif ":" in name:
        factory = _import_factory(name)
        check_factory_call(factory, "model.name", name, "a torch.nn.Module")
    else:
        raise unknown_model_error(name, set(_REGISTRY))
    model = factory(model_cfg)
    if not isinstance(model, nn.Module):
        raise SpeedtronicError(f"model factory {name!r} returned {type(model).__name__}, "
                               "expected a torch.nn.Module")
    model = adapt_model(model)  # a Hugging Face model is called with keywords
    wants_ckpt = model_cfg.gradient_checkpointing or bool(getattr(cfg, "gradient_checkpointing",
                                                                  False))
    setter = getattr(model, "set_gradient_checkpointing", None)
    if wants_ckpt:
        if setter is None:
            raise ConfigError(f"gradient_checkpointing: model {name!r} has no "
                              "set_gradient_checkpointing(bool) method; disable the option or "
                              "implement the method")
        setter(True)
    n_params = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    logger.info("model: %s, %s parameters, gradient checkpointing %s", name, f"{n_params:,}",
                "on" if wants_ckpt else "off")
    return model

