"""The models that ship with the package, by name, their sizes in closed form, and which
``model.*`` changes make another architecture (:func:`architecture_changes`: ``--resume``,
``model.init_from`` and a DiLoCo node joining a run refuse those).

Imports no torch: ``speedtronic validate`` resolves ``model.name`` and checks that a model's
size can be trained here without loading torch (0.2 s instead of ~2.5 s).
"""

from __future__ import annotations

import math
from typing import Any

from ..errors import ConfigError

__all__ = ["BUILTIN_MODELS", "REFERENCE_MODELS", "architecture_changes", "builtin_parameters",
           "swiglu_hidden", "unknown_model_error"]

#: The models that ship with the package: ``model.name`` -> ``"module:factory"``.
BUILTIN_MODELS: dict[str, str] = {
    "reference_transformer": "speedtronic.models.reference:build_reference_transformer",
    "gpt": "speedtronic.models.reference:build_reference_transformer",
    "hf": "speedtronic.models.hf:build_hf_model",
}
#: The built-ins whose sizes follow ModelConfig's fields (``hf`` follows ``model.hf_config``).
REFERENCE_MODELS = ("reference_transformer", "gpt")


def swiglu_hidden(d_model: int, d_ff: int | None) -> int:
    """SwiGLU hidden width: ``d_ff`` if given, else 8/3 * d_model rounded up to a multiple of 64.

    8/3 keeps the parameter count of a 4x GELU MLP (three matrices instead of two); the
    multiple of 64 keeps the GEMM dims aligned for tensor cores.
    """
    if d_ff is not None:
        return d_ff
    return 64 * math.ceil(8 * d_model / 3 / 64)


def builtin_parameters(model: Any) -> int | None:
    """Parameters of a built-in decoder from its ``ModelConfig`` (norm gains left out: within
    0.1% at any size that matters); None for a model that is not built in."""
    if model.name not in REFERENCE_MODELS:
        return None
    d, vocab = model.d_model, model.vocab_size or 256
    kv = (model.n_kv_head or model.n_head) * (d // max(1, model.n_head))
    per_layer = 2 * d * d + 2 * d * kv + 3 * d * swiglu_hidden(d, model.d_ff)  # attn + SwiGLU
    return model.n_layer * per_layer + vocab * d * (1 if model.tie_weights else 2)


def unknown_model_error(name: str, registered: set[str] | frozenset[str] = frozenset()
                        ) -> ConfigError:
    """The one message for a ``model.name`` that names nothing (registry and ``validate``)."""
    known = ", ".join(sorted(set(BUILTIN_MODELS) | set(registered)))
    return ConfigError(f"model.name: unknown model {name!r}; registered models: {known} (or "
                       "use 'package.module:factory')")


#: Model keys a resumed run may change: they change how the same weights are trained or run,
#: not which function they compute. Any other model.* change is refused (a different n_head or
#: rope_base over the same tensors would silently train another model).
_RESUMABLE_MODEL_KEYS = frozenset({"dropout", "gradient_checkpointing", "max_seq_len",
                                   "init_from"})


def architecture_changes(saved: dict[str, Any], current: dict[str, Any],
                         where: str = "the checkpoint") -> str:
    """``model.k is X here but Y in the checkpoint; ...`` for the first 4 architecture keys
    that differ (every model.* key but dropout, gradient checkpointing, max_seq_len and
    init_from, with computed defaults resolved); "" when none does or nothing was saved.
    ``--resume`` and ``model.init_from`` both refuse such a change: the same tensors under
    another n_head or rope_base compute another function."""
    saved_model, current_model = _resolved_architecture(saved), _resolved_architecture(current)
    changed = [k for k in sorted(set(saved_model) | set(current_model))
               if saved_model and k not in _RESUMABLE_MODEL_KEYS
               and saved_model.get(k) != current_model.get(k)]
    return "; ".join(f"model.{k} is {current_model.get(k)!r} here but {saved_model.get(k)!r} "
                     f"in {where}" for k in changed[:4])


def _resolved_architecture(model: dict[str, Any]) -> dict[str, Any]:
    """The reference model's keys whose null means a computed value, resolved: ``d_ff: 128``
    and ``d_ff: null`` (which is 128 at d_model 48) build the same model, and a resume once
    refused the explicit spelling of the value it had trained with."""
    if model.get("name") not in REFERENCE_MODELS or "d_model" not in model:
        return model
    model = dict(model)
    model["name"] = REFERENCE_MODELS[0]  # "gpt" is the same model under another name
    if model.get("n_kv_head") is None:
        model["n_kv_head"] = model.get("n_head")
    if "d_ff" in model:
        model["d_ff"] = swiglu_hidden(model["d_model"], model["d_ff"])
    return model
