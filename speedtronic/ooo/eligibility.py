"""Which layers out-of-order backprop can take over, and whether it can run at all.

:func:`find_deferrable_linears` picks the plain ``nn.Linear`` layers (optionally only under
``model.ooo_stage_names``); :func:`_fallback_reason` is the config and device check behind
:func:`~speedtronic.ooo.scheduler.build_ooo_scheduler`: the one sentence it logs when it
leaves the feature off. Neither touches a layer or a stream.
"""

from __future__ import annotations

import torch
from torch import nn

from ..config import SpeedtronicConfig


def find_deferrable_linears(model: nn.Module) -> list[tuple[str, nn.Linear]]:
    """The ``nn.Linear`` layers whose weight gradients can be deferred, in module order.

    ``model.ooo_stage_names`` (a list of submodule names) restricts the search to those
    submodules; otherwise every ``nn.Linear`` with a trainable, plain weight qualifies.
    Raises ``ValueError`` for a stage name that is not a submodule.
    """
    names = getattr(model, "ooo_stage_names", None)
    if names is None:
        roots: list[tuple[str, nn.Module]] = [("", model)]
    else:
        if isinstance(names, str) or not all(isinstance(n, str) for n in names):
            raise ValueError(f"model.ooo_stage_names must be a list of submodule names, got "
                             f"{names!r}")
        roots = []
        for name in names:
            try:
                roots.append((name, model.get_submodule(name)))
            except AttributeError:
                raise ValueError(f"model.ooo_stage_names: {name!r} is not a submodule of "
                                 f"{type(model).__name__}") from None
    found: dict[nn.Module, str] = {}  # module -> name; modules are alive, keys are the objects
    for prefix, root in roots:
        for name, m in root.named_modules(prefix=prefix):
            if m not in found and _is_plain_linear(m):
                found[m] = name or type(m).__name__
    return [(name, m) for m, name in found.items()]


def _is_plain_linear(m: nn.Module) -> bool:
    if not isinstance(m, nn.Linear) or type(m).forward is not nn.Linear.forward:
        return False
    w = m._parameters.get("weight")
    if not isinstance(w, nn.Parameter) or not w.requires_grad:
        return False
    if not w.is_floating_point() or w.dtype == torch.float64 or w.layout != torch.strided:
        return False
    if torch.nn.utils.parametrize.is_parametrized(m):
        return False
    b = m._parameters.get("bias")
    return b is None or (isinstance(b, nn.Parameter) and b.requires_grad)


def _fallback_reason(cfg: SpeedtronicConfig, device: torch.device, force_cpu: bool) -> str | None:
    if not cfg.ooo_backprop:
        return "ooo_backprop: false"
    # With ooo_backprop on, only ``compile: true`` compiles (the precision layer's
    # decide_compile turns ``auto`` off for it), so this reads the flag instead of importing
    # the training layer above this one.
    if cfg.compile is True:
        return ("compile: true; torch.compile and ooo_backprop are mutually exclusive in this "
                "release")
    if device.type == "cpu" and force_cpu:
        return None
    if device.type != "cuda" or not torch.cuda.is_available():
        return f"no CUDA (device {device})"
    if torch.cuda.is_current_stream_capturing():
        return "CUDA graph capture is active"
    return None
