"""The ops that transform one matrix (or a ``(b, m, n)`` batch): ``newton_schulz``, the polar
factor Muon orthogonalizes with, and ``muon_plus_normalize``, Muon+'s row-then-column
normalization of its result.

Schema, fake kernel and PyTorch body of each op side by side. ``newton_schulz`` has no CUDA kernel
of its own (its Python body drives cuBLAS GEMMs; the math is :mod:`.newton_schulz`);
``muon_plus_normalize`` has one in ``csrc/``. :mod:`.ops` imports this module, and that import is
what registers the ops: use them through :mod:`.ops`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from . import newton_schulz as _ns
from .newton_schulz import QUINTIC

__all__ = ["newton_schulz", "muon_plus_normalize"]


# ---------------------------------------------------------------------------------------------
# newton_schulz
# ---------------------------------------------------------------------------------------------

_NS_METHODS = ("auto", "standard", "gram")


def _check_ns_args(G: Tensor, steps: int, coefficients: Sequence[float], method: str) -> None:
    if G.dim() not in (2, 3):
        raise ValueError(f"newton_schulz expects a (m, n) or (b, m, n) tensor, got shape "
                         f"{tuple(G.shape)}")
    if not G.is_floating_point():
        raise ValueError(f"newton_schulz expects a floating-point tensor, got {G.dtype}")
    if steps < 1:
        raise ValueError(f"newton_schulz steps must be >= 1, got {steps}")
    if method not in _NS_METHODS:
        raise ValueError(f"newton_schulz method must be one of {', '.join(_NS_METHODS)}, got "
                         f"{method!r}")
    if len(coefficients) not in (3, 3 * steps):
        raise ValueError(f"newton_schulz coefficients must hold 3 or 3*steps={3 * steps} floats, "
                         f"got {len(coefficients)}")


@torch.library.custom_op(
    "speedtronic::newton_schulz", mutates_args=(), device_types=None,
    schema="(Tensor G, int steps=5, float[] coefficients=[3.4445,-4.775,2.0315], float eps=1e-7, "
           "ScalarType? compute_dtype=None, str method=\"auto\", bool normalized=False) -> Tensor")
def newton_schulz(G: Tensor, steps: int = 5, coefficients: Sequence[float] = QUINTIC,
                  eps: float = 1e-7, compute_dtype: torch.dtype | None = None,
                  method: str = "auto", normalized: bool = False) -> Tensor:
    """Approximate polar factor of ``G`` by an odd quintic Newton-Schulz iteration.

    ``G`` is ``(m, n)`` or a batch ``(b, m, n)`` (each matrix independently). Each matrix is
    divided by ``max(||G||_F, eps)`` (torch.optim.Muon's clamp; an all-zero matrix stays exactly
    zero), then ``steps`` times ``X <- a X + (b A + c A^2) X`` with ``A = X X^T``, on the wide
    orientation (tall matrices are transposed internally). ``coefficients`` holds 3 floats (used
    every iteration) or ``3 * steps`` floats (a per-iteration schedule, e.g.
    :func:`polar_express_coefficients`).
    With the default quintic, singular values above ~0.3% of ``||G||_F`` land in roughly
    [0.68, 1.20] rather than at 1 (smaller ones stay below the band).

    ``compute_dtype`` is the matmul dtype: None = fp16 on CUDA, fp32 elsewhere (fp64 input stays
    fp64). ``method``: ``"standard"``, ``"gram"`` (iterate on ``X X^T``; for rectangular shapes
    and tuned schedules, else standard) or ``"auto"`` (Gram from aspect
    :data:`GRAM_MIN_ASPECT`). ``normalized=True`` says ``G`` is already divided by its
    Frobenius norm (as :func:`muon_pre_orthogonalize_` returns it) and skips that pass. The
    result has ``G``'s dtype and shape. ``G`` is not modified.

    Every FLOP is a batched GEMM, so this Python body is the implementation on every device
    (cuBLAS on CUDA): there is no separate CUDA kernel to drift from it
    (:mod:`speedtronic.kernels.newton_schulz` has the math).
    """
    return _newton_schulz_impl(G, steps, coefficients, eps, compute_dtype, method, normalized)


def _newton_schulz_impl(G: Tensor, steps: int = 5, coefficients: Sequence[float] = QUINTIC,
                        eps: float = 1e-7, compute_dtype: torch.dtype | None = None,
                        method: str = "auto", normalized: bool = False) -> Tensor:
    _check_ns_args(G, steps, coefficients, method)
    return _ns.orthogonalize(G, steps, coefficients, eps, compute_dtype, method, normalized)


@newton_schulz.register_fake
def _(G, steps=5, coefficients=QUINTIC, eps=1e-7, compute_dtype=None, method="auto",
      normalized=False):
    _check_ns_args(G, steps, coefficients, method)
    return torch.empty_like(G, memory_format=torch.contiguous_format)


# ---------------------------------------------------------------------------------------------
# muon_plus_normalize
# ---------------------------------------------------------------------------------------------

def _check_matrix(U: Tensor, what: str) -> None:
    if U.dim() not in (2, 3) or not U.is_floating_point():
        raise ValueError(f"{what} expects a floating (m, n) or (b, m, n) tensor, got "
                         f"{U.dtype} {tuple(U.shape)}")


def _muon_plus_impl(U: Tensor, eps: float) -> Tensor:
    # Low-precision inputs are normalized in fp32 and cast back.
    work = U.float() if U.dtype in (torch.bfloat16, torch.float16) else U
    rows = work.square().sum(dim=-1, keepdim=True).add_(eps).rsqrt_()   # (..., m, 1)
    out = work * rows
    cols = out.square().sum(dim=-2, keepdim=True).add_(eps).rsqrt_()    # (..., 1, n)
    return out.mul_(cols).to(U.dtype)


@torch.library.custom_op("speedtronic::muon_plus_normalize", mutates_args=(), device_types=None,
                         schema="(Tensor U, float eps=1e-8) -> Tensor")
def muon_plus_normalize(U: Tensor, eps: float = 1e-8) -> Tensor:
    """Muon+ normalization (arXiv 2602.21545, ``row_col`` mode): divide each row of ``U`` by
    ``sqrt(sum_j U_ij^2 + eps)``, then each column of the result by ``sqrt(sum_i V_ij^2 + eps)``.

    Rows and columns are those of the parameter's layout (rows = fan_out of an ``nn.Linear``).
    ``U`` is ``(m, n)`` or ``(b, m, n)``; bf16/fp16 are computed in fp32 and returned in ``U``'s
    dtype. The result is contiguous whatever ``U``'s layout (the CUDA kernel writes a fresh
    contiguous tensor; the fake said ``U``'s strides, so a compiled graph planned a transposed
    input's result with the wrong ones)."""
    _check_matrix(U, "muon_plus_normalize")
    return _muon_plus_impl(U, eps).contiguous()


@muon_plus_normalize.register_fake
def _(U, eps=1e-8):
    _check_matrix(U, "muon_plus_normalize")
    return U.new_empty(U.shape)
