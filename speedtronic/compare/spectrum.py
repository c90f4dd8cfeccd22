"""Singular-value spectra of a model's hidden weight matrices.

Muon replaces each update by (approximately) its orthogonal polar factor, which flattens the
update's spectrum; trained weights therefore tend to have a higher stable rank than AdamW's.
This module measures that, per 2-D hidden matrix:

* stable rank ``||W||_F^2 / ||W||_2^2 = sum(s^2) / s_max^2`` (1 = rank one, up to min(m, n));
* effective rank ``exp(H(p))`` with ``p_i = s_i / sum(s)`` (Roy & Vetterli, 2007);
* the top singular values.

"Hidden" = the matrices Muon would own: 2-D parameters that are not embeddings or the output
head (those stay on AdamW in the hybrid optimizer).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

__all__ = ["hidden_matrices", "matrix_spectrum", "model_spectrum", "summarize_spectra"]

TOP_K = 8
"""Singular values kept per matrix in the JSON."""


def hidden_matrices(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """``(name, weight)`` of the matrices the hybrid optimizer routes to Muon (hidden 2-D
    ``nn.Linear`` weights; embeddings, tied or untied heads, norms and biases excluded).

    Uses :func:`speedtronic.optim.routing.route_parameters`, so "hidden" means exactly what
    Muon trains; without the optimizer package, 2-D Linear weights that are not tied to an
    embedding and not named like a head.
    """
    try:
        from ..optim.routing import route_parameters
    except ImportError:
        route_parameters = None
    if route_parameters is not None:
        return list(route_parameters(model).muon)
    embedding_ids = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    return [(f"{mod_name}.weight", m.weight) for mod_name, m in model.named_modules()
            if isinstance(m, nn.Linear) and m.weight.requires_grad
            and id(m.weight) not in embedding_ids
            and mod_name.rsplit(".", 1)[-1] not in ("lm_head", "head", "output")]


@torch.no_grad()
def matrix_spectrum(weight: torch.Tensor, top_k: int = TOP_K) -> dict[str, Any]:
    """Stable rank, effective rank and top singular values of one matrix (computed in fp64 on
    CPU: exact enough for ranks near the full dimension, and the matrices are small)."""
    s = torch.linalg.svdvals(weight.detach().to("cpu", torch.float64))  # (min(m, n),) descending
    smax = float(s[0]) if s.numel() else 0.0
    if smax <= 0.0:
        return {"shape": list(weight.shape), "stable_rank": 0.0, "effective_rank": 0.0,
                "top_singular_values": [0.0] * min(top_k, s.numel()), "frobenius": 0.0}
    p = s / s.sum()
    p = p[p > 0]
    entropy = float(-(p * p.log()).sum())
    return {
        "shape": list(weight.shape),
        "stable_rank": float((s * s).sum()) / (smax * smax),
        "effective_rank": math.exp(entropy),
        "top_singular_values": [float(v) for v in s[:top_k]],
        "frobenius": float(torch.linalg.vector_norm(s)),
    }


def model_spectrum(model: nn.Module, top_k: int = TOP_K) -> dict[str, dict[str, Any]]:
    """``{parameter name: matrix_spectrum}`` for every hidden matrix, in model order."""
    return {name: matrix_spectrum(w, top_k) for name, w in hidden_matrices(model)}


def summarize_spectra(spectra: dict[str, dict[str, Any]]) -> dict[str, float]:
    """Means over layers of stable rank, effective rank and the relative stable rank (stable rank
    divided by min(m, n), comparable across matrices of different shapes)."""
    if not spectra:
        return {"mean_stable_rank": float("nan"), "mean_effective_rank": float("nan"),
                "mean_relative_stable_rank": float("nan"), "matrices": 0}
    rows = list(spectra.values())
    n = len(rows)
    return {
        "mean_stable_rank": sum(r["stable_rank"] for r in rows) / n,
        "mean_effective_rank": sum(r["effective_rank"] for r in rows) / n,
        "mean_relative_stable_rank": sum(r["stable_rank"] / min(r["shape"]) for r in rows) / n,
        "matrices": n,
    }
