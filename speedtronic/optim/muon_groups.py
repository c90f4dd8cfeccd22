"""What a Muon parameter group may hold: its defaults, the ``ns_dtype`` and ``layout`` names, and
the checks a group passes when it is added.

Checked when a group is added (``add_param_group`` of :class:`~.muon.Muon` and of
:class:`~.build.HybridOptimizer`'s Muon groups; a rejected group is removed again), so a bad value
fails there with a message naming the key, not as a shape error or NaN weights steps later; the
step only refuses what a group cannot show in advance (a complex or sparse gradient). Where
torch.optim.Muon has a check, its message is kept; the stricter ones say why.
"""

from __future__ import annotations

import numbers
from typing import Any

import torch
from torch import Tensor

from ..kernels import ops
from .dtensor_step import is_dtensor
from .muon_step import NS_DTYPES, adjusted_lr_scale

__all__ = ["MUON_DEFAULTS", "parse_layout", "resolve_ns_dtype"]

MUON_DEFAULTS: dict[str, Any] = {
    "lr": 1e-3,
    "weight_decay": 0.1,
    "momentum": 0.95,
    "nesterov": True,
    "ns_coefficients": ops.QUINTIC,
    "eps": 1e-7,
    "ns_steps": 5,
    "adjust_lr_fn": None,
    "muon_plus": False,
    "norm_eps": 1e-8,
    "cautious": False,
    "cautious_rescale": True,
    "ns_dtype": "auto",
    "layout": "matrix",
}
"""Per-group defaults; the first eight are torch.optim.Muon's, with the same values."""

_DTYPE_NAMES = {v: k for k, v in NS_DTYPES.items() if v is not None}


def resolve_ns_dtype(spec: str | torch.dtype | None) -> str:
    """Normalize an NS dtype spec (None, a torch dtype, or auto/bf16/fp16/fp32/fp64) to its name.

    Stored as a string so ``state_dict()`` holds no custom objects."""
    if spec is None:
        return "auto"
    if isinstance(spec, torch.dtype):
        if spec not in _DTYPE_NAMES:
            raise ValueError(f"ns_dtype {spec} is not supported; valid: "
                             f"{', '.join(str(d) for d in _DTYPE_NAMES)} or their names "
                             f"{sorted(NS_DTYPES)}")
        return _DTYPE_NAMES[spec]
    if spec not in NS_DTYPES:
        raise ValueError(f"ns_dtype {spec!r} is not valid; use one of {sorted(NS_DTYPES)}")
    return spec


def parse_layout(layout: str) -> tuple[str, int]:
    """``"matrix"`` | ``"transposed"`` | ``"split:K"`` -> (kind, K); ValueError otherwise.

    * ``matrix``: the weight is ``(out, in)`` (``nn.Linear``);
    * ``transposed``: the weight is stored ``(in, out)`` (Hugging Face ``Conv1D``): the polar
      factor of the transpose is the transpose of the polar factor, so only the lr scale must
      use the logical ``(out, in)`` shape;
    * ``split:K``: K matrices stacked along dim 0 (fused Q/K/V: ``K = 3``), each orthogonalized
      on its own: Q, K and V are separate linear maps;
    * ``transposed_split:K``: K matrices stored transposed side by side, ``(in, K * out)``
      (GPT-2's fused ``c_attn`` ``Conv1D``): each column block is orthogonalized on its own,
      through a contiguous ``(out, in)`` copy written back after the step; the momentum buffer
      is kept in that logical ``(K * out, in)`` layout;
    * ``flatten``: a convolution kernel ``(out, in, *k)`` orthogonalized as the matrix
      ``(out, in * prod(k))`` (a view; a channels_last kernel goes through a contiguous copy
      written back after the step)."""
    if layout in ("matrix", "transposed", "flatten"):
        return layout, 1
    for kind in ("split", "transposed_split"):
        if isinstance(layout, str) and layout.startswith(f"{kind}:") \
                and layout[len(kind) + 1:].isdigit() and int(layout[len(kind) + 1:]) >= 1:
            return kind, int(layout[len(kind) + 1:])
    raise ValueError(f"layout {layout!r} is not valid; use 'matrix', 'transposed', 'flatten', "
                     "'split:K' or 'transposed_split:K'")


def _check_dtensor(p: Tensor, kind: str) -> None:
    """FSDP2 (``fully_shard``) parameters: plain 2-D matrices sharded by rows, nothing else
    (see :mod:`.dtensor_step`)."""
    from torch.distributed.tensor import Shard

    if kind != "matrix" or p.ndim != 2:
        raise ValueError(f"Muon on a DTensor parameter (FSDP2) takes plain 2-D matrices with "
                         f"layout 'matrix'; got shape {tuple(p.shape)}, layout {kind!r}")
    if any(isinstance(pl, Shard) and pl.dim != 0 for pl in p.placements):
        raise ValueError(f"Muon on a DTensor parameter: only row sharding (Shard(0), what "
                         f"fully_shard does) is supported, got placements {p.placements}")


def _check_group(group: dict[str, Any]) -> None:
    lr = group["lr"]
    if isinstance(lr, Tensor) and lr.numel() != 1:
        raise ValueError("Tensor lr must be 1-element")
    if not 0.0 <= float(lr):
        raise ValueError(f"Learning rate should be >= 0 but is: {lr}")
    if not 0.0 <= group["momentum"]:
        raise ValueError(f"momentum should be >= 0 but is: {group['momentum']}")
    if not 0.0 <= group["weight_decay"]:
        raise ValueError(f"weight decay should be >= 0 but is: {group['weight_decay']}")
    # Stricter than torch.optim.Muon (messages above are torch's): momentum 1 or more never
    # forgets (a buffer at 2.9e5 after 30 steps at 1.5), and eps or norm_eps 0 turn a zero
    # gradient, or a zero row under Muon+, into 0/0 = NaN weights.
    if not group["momentum"] < 1.0:
        raise ValueError(f"momentum must be in [0, 1), got {float(group['momentum'])}")
    for key in ("eps", "norm_eps"):
        if not group[key] > 0.0:
            raise ValueError(f"{key} must be > 0 (it keeps a zero gradient's normalization "
                             f"finite), got {group[key]}")
    for key in ("nesterov", "muon_plus", "cautious", "cautious_rescale"):
        if not isinstance(group[key], bool):
            raise TypeError(f"{key} must be True or False, got {group[key]!r}")
    if isinstance(group["ns_steps"], bool) or not isinstance(group["ns_steps"], numbers.Integral):
        raise TypeError(f"ns_steps must be an int, got {group['ns_steps']!r}")
    if group["ns_steps"] < 1 or group["ns_steps"] >= 100:
        raise ValueError(f"ns_steps must be in [1, 100), got {group['ns_steps']}")
    adjusted_lr_scale(group["adjust_lr_fn"], (1, 1))
    ops.resolve_coefficients(group["ns_coefficients"], group["ns_steps"])
    group["ns_dtype"] = resolve_ns_dtype(group["ns_dtype"])
    if isinstance(group["ns_coefficients"], tuple):
        group["ns_coefficients"] = list(group["ns_coefficients"])
    kind, k = parse_layout(group.get("layout", "matrix"))
    for p in group["params"]:
        if is_dtensor(p):
            _check_dtensor(p, kind)
        if kind == "flatten" and p.ndim >= 2:
            continue
        if p.ndim != 2:
            raise ValueError("Muon only supports 2D parameters whereas we found a parameter with "
                             f"size: {p.size()} (route it to AdamW; see "
                             "speedtronic.optim.route_parameters)")
        if kind == "split" and p.shape[0] % k:
            raise ValueError(f"layout split:{k} needs rows divisible by {k}, got shape "
                             f"{tuple(p.shape)}")
        if kind == "transposed_split" and p.shape[1] % k:
            raise ValueError(f"layout transposed_split:{k} needs columns divisible by {k}, got "
                             f"shape {tuple(p.shape)}")
