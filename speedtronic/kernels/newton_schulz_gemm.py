"""The products inside a Newton-Schulz iteration (``X X^T``, ``b A + c A^2``, the folded
``a I + b A + c A^2``) and which GEMM computes each.

Three routes per product: torch's cuBLAS/BLAS call, the CPU's block-lower-triangle symmetric
product (fp32 and fp64 from 256 rows), and the optional kernel families below, each a
:class:`~.choice.MeasuredKernel` with its environment switch. The iterations themselves (and the
one whole-iteration family, ``ns_step_lt``, which wraps an iteration rather than a product) are
in :mod:`.newton_schulz`.

Patching: the families and :data:`COPY_FREE_FOLD_ON_CPU` are read here, so a test swaps them on
this module (``newton_schulz`` does not re-export them, so a patch left on the old module fails
instead of doing nothing). The product functions are called by the iterations through names
imported into :mod:`.newton_schulz`: patch ``_fold_poly`` there.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .choice import TOLERANCE_16BIT, MeasuredKernel, debug_op

__all__ = [
    "COPY_FREE_FOLD_ON_CPU",
    "CUBLASLT_ENV",
    "NS_STEP_LT",
    "POLY_LT",
    "SYM_BLOCK_MIN_ROWS",
    "SYM_GEMM",
    "SYM_GEMM_DEFAULT_ON",
    "SYM_GEMM_ENV",
]

# ------------------------------------------------------------------ optional GEMM kernels
# Two families may replace torch's cuBLAS call per shape (speedtronic.kernels.choice: used only
# where measured faster on this GPU, checked against cuBLAS first, any error switches the family
# off with one log line):
# * sym_gemm (csrc/kernels/sym_gemm_sm90.cuh): X X^T and b A + c A^2 on lower-triangle tiles only
#   (TMA + wgmma, sm_90a). Verified in the CPU emulation and by compile/SASS gates only: no GPU
#   has run it, so it is OFF by default (SYM_GEMM_DEFAULT_ON); SPEEDTRONIC_SYM_GEMM=1 opts in.
# * poly_lt (csrc/cublaslt_poly.h): b A + c A^2 as one cuBLASLt call with C != D, without the
#   copy of A into the output that torch.baddbmm makes before its GEMM; and ns_step_lt, a whole
#   standard iteration after X X^T (P = b A + c A^2, then a X + P X with C = X, D = new) in two
#   such calls: 3 launches per iteration with X X^T, where fp16's fold takes 4 (X X^T,
#   A + (a/b) I, an in-place baddbmm, a bmm) and bf16's baddbmm route 3-5 (its copies).
#   Production cuBLAS, so both are candidates by default; SPEEDTRONIC_CUBLASLT=0 switches them
#   off.

SYM_GEMM_ENV = "SPEEDTRONIC_SYM_GEMM"
SYM_GEMM_DEFAULT_ON = False
"""Whether the Hopper kernel is a candidate when SPEEDTRONIC_SYM_GEMM is unset (not before a GPU
run has measured it)."""
CUBLASLT_ENV = "SPEEDTRONIC_CUBLASLT"


def _is_hopper(X: Tensor) -> bool:
    return X.device.type != "cuda" or torch.cuda.get_device_capability(X.device) == (9, 0)


SYM_GEMM = MeasuredKernel("sym_gemm (Hopper kernel)", "sym_gemm", SYM_GEMM_ENV,
                          SYM_GEMM_DEFAULT_ON, debug_op("sym_gemm"), symmetric=True,
                          device_ok=_is_hopper)
POLY_LT = MeasuredKernel("poly_lt (cuBLASLt, C != D)", "cublaslt", CUBLASLT_ENV, True,
                         debug_op("poly_lt"))
NS_STEP_LT = MeasuredKernel("ns_step_lt (cuBLASLt, C != D)", "cublaslt_step", CUBLASLT_ENV, True,
                            debug_op("ns_step_lt"))


def _dtype_name(X: Tensor) -> str:
    return str(X.dtype).removeprefix("torch.")


# CPU only: a product known to be symmetric is computed on its block-lower triangle (4 row
# blocks: 10 of 16 blocks' FLOPs) and mirrored. Single thread, fp32, this cut X X^T by 27-35%
# at m = 256-2048 (48 x 768^2: 490 -> 358 ms; 24 x 768x3072: 901 -> 605 ms; 6 x 256^2: 2.2 ->
# 1.6 ms) and the GPT-2-small NS by 17-22%. The fp32 error against float64 moved by <= 1.05x
# on power-law spectra and up to 2.6x (to 3.7e-6) on Gaussian ones in Gram NS. Mirroring P Q
# and R P as well (symmetric only in exact arithmetic) made Gram's error 2-5x larger: those
# stay full GEMMs. A blocked product costs 6 more ops than one bmm, hence the threshold.
SYM_BLOCK_MIN_ROWS = 256
_SYM_BLOCKS = 4



def _sym_bmm(X: Tensor, Y: Tensor, out: Tensor | None = None) -> Tensor:
    """``X Y^T`` for ``X, Y (b, m, k)`` when entry ``(i, j)`` and ``(j, i)`` are the same dot
    product (``X X^T``; ``A A = A A^T`` for a symmetric ``A``), so mirroring loses nothing."""
    b, m, _ = X.shape
    if X.device.type != "cpu" or m < SYM_BLOCK_MIN_ROWS or X.dtype in TOLERANCE_16BIT:
        # 16-bit CPU: bmm into a strided out is 2x slower, not faster
        return torch.bmm(X, Y.mT, out=out)
    if out is None:
        out = torch.empty((b, m, m), dtype=torch.promote_types(X.dtype, Y.dtype),
                          device=X.device)
    bounds = [m * i // _SYM_BLOCKS for i in range(_SYM_BLOCKS + 1)]
    for r0, r1 in zip(bounds[:-1], bounds[1:], strict=True):  # block row i, columns [0, r1)
        torch.bmm(X[:, r0:r1], Y[:, :r1].mT, out=out[:, r0:r1, :r1])
    for r0, r1 in zip(bounds[1:-1], bounds[2:], strict=True):  # upper := lower blocks^T
        out[:, :r0, r0:r1].copy_(out[:, r0:r1, :r0].mT)
    return out


def _xxt(X: Tensor, out: Tensor | None = None) -> Tensor:
    """``X X^T`` for ``X (b, m, k)``."""
    if X.dtype not in TOLERANCE_16BIT:
        return _sym_bmm(X, X, out)
    b, m, k = X.shape
    return SYM_GEMM.run(f"sym_gemm xxt {b}x{m}x{k} {_dtype_name(X)}", X,
                        lambda: torch.bmm(X, X.mT, out=out), lambda op: op(X, 1.0, 0.0, None))


def _poly(A: Tensor, b: float, c: float, out: Tensor | None = None) -> Tensor:
    """``b A + c A^2`` for symmetric ``A`` (b, m, m), as a new tensor (or into ``out``)."""
    if A.device.type == "cpu" and A.dtype in (torch.float32, torch.float64):
        # CPU: a GEMM with beta != 0 is 1.3-1.5x slower than the plain GEMM plus an add.
        return _sym_bmm(A, A, out).mul_(c).add_(A, alpha=b)       # A A = A A^T
    if A.dtype not in TOLERANCE_16BIT:
        return torch.baddbmm(A, A, A, beta=b, alpha=c, out=out)  # one rounding (fp32 acc.)
    n, m = A.shape[0], A.shape[1]

    def cublas() -> Tensor:  # torch.baddbmm (copies A into the output first), or cuBLASLt
        return POLY_LT.run(f"poly_lt {n}x{m} {_dtype_name(A)}", A,
                           lambda: torch.baddbmm(A, A, A, beta=b, alpha=c, out=out),
                           lambda op: op(A, b, c))

    return SYM_GEMM.run(f"sym_gemm poly {n}x{m} {_dtype_name(A)}", A, cublas,
                        lambda op: op(A, c, b, A))


_IDENTITY: dict[tuple[int, torch.dtype, str], Tensor] = {}


def _identity(m: int, like: Tensor) -> Tensor:
    """A cached ``(m, m)`` identity in ``like``'s dtype and device (2 MiB at m = 1024, fp16),
    never created inside a CUDA-graph capture (its kernels would only be recorded, not run)."""
    key = (m, like.dtype, str(like.device))
    eye = _IDENTITY.get(key)
    if eye is None:
        eye = torch.eye(m, dtype=like.dtype, device=like.device)
        capturing = like.device.type == "cuda" and torch.cuda.is_current_stream_capturing()
        if not capturing:
            _IDENTITY[key] = eye
    return eye


COPY_FREE_FOLD_ON_CPU = False
"""Whether the CPU takes :func:`_fold_poly`'s GPU route too (tests set it to check that route's
algebra and op count on CPU; a CPU run has no reason to)."""


def _fold_poly(A: Tensor, a: float, b: float, c: float, out: Tensor | None = None) -> Tensor:
    """``a I + b A + c A^2`` for symmetric ``A (b, m, m)``: the polynomial that multiplies ``X``.

    Off the CPU, 2 launches: ``out = A + (a/b) I`` (an add that takes the place of the copy of
    ``A`` which ``baddbmm`` makes before its GEMM) and ``out.baddbmm_(A, A, beta=b, alpha=c)``
    (in place, C == D). The old route was that copy, the GEMM and a separate ``a I`` diagonal
    add: 4 launches per standard iteration now instead of 5 for the same GEMM work (GPT-2
    small's step: 89 -> 79 estimated launches). Off-diagonal entries are copied exactly and
    rounded once, by the GEMM; the diagonal rounds ``A_ii + a/b`` where it used to round
    ``B_ii + a``. With cuBLAS's rounding (fp16 in, fp32 accumulate, one rounding out) the fp16
    error against float64 is 0.66-1.01x the old route's (``benchmarks/bench_fold_rounding.py``,
    results in ``benchmarks/results/fold_rounding.md``). The CPU keeps the old route: its fp16
    ``baddbmm`` rounds differently (Polar Express up to 1.99x the old route's error there) and its
    fp32 GEMM with beta != 0 is 1.3-1.5x slower (see :func:`_poly`); so do ``b = 0`` and the
    opt-in Hopper kernel. ``poly_lt`` (cuBLASLt, C != D) would save nothing here (1 launch plus
    the diagonal add), so it serves bf16, which does not fold."""
    on_cpu = A.device.type == "cpu" and not COPY_FREE_FOLD_ON_CPU
    if b == 0.0 or on_cpu or (A.dtype in TOLERANCE_16BIT and SYM_GEMM.op() is not None):
        P = _poly(A, b, c, out)
        P.diagonal(dim1=-2, dim2=-1).add_(a)
        return P
    P = torch.add(A, _identity(A.shape[-1], A), alpha=a / b, out=out)  # (b, m, m)
    return P.baddbmm_(A, A, beta=b, alpha=c)                            # A A = A A^T

