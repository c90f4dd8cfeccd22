"""Newton-Schulz orthogonalization: the standard and the Gram iteration, and the op's body.

This is the math behind the ``speedtronic::newton_schulz`` op (registered in :mod:`.ops`) on
every device: each FLOP is a batched GEMM (cuBLAS on CUDA, oneDNN/MKL on CPU), so one Python
implementation serves both and the CPU tests cover the exact CUDA code path. The hand-written
kernels sit around it (the Muon pre- and post-passes) and, later, inside it (a symmetric GEMM
chosen per shape by :mod:`.autotune`).

Two iterations of the same polynomial ``p(x) = a x + b x^3 + c x^5`` on the wide orientation
``X (b, m, n)``, ``m <= n``, Frobenius-normalized so every singular value is <= 1:

* **standard**: ``A = X X^T``, ``B = b A + c A^2``, ``X <- a X + B X``: 2 m^2 n + m^3 MACs per
  iteration.
* **Gram** (iterate on ``R = X X^T``): with ``P_k = a I + b R_k + c R_k^2``,
  ``X_{k+1} = P_k X_k`` and ``R_{k+1} = P_k R_k P_k`` (``P_k`` is a polynomial in ``R_k``, so
  they commute); only the first ``R``, the restarts and the final ``Q X`` touch the long side
  ``n``: about 4 m^3 per iteration plus 2 m^2 n per restart. It wins from ``n ~ 2 m`` on.
  Without restarts ``R`` drifts and the iteration diverges in 16-bit (errors of 1.6 to 7.8 on
  power-law spectra in the H200 run); :data:`GRAM_RESTARTS` places them per schedule, as tuned by
  ``benchmarks/tune_gram_restarts.py`` (results in ``benchmarks/results/gram_restarts.md``).

Why fp16 cannot overflow here (the ``auto`` dtype on CUDA): after normalization ``||X||_2 <= 1``,
so ``|X_ij| <= 1`` and ``||A||_2 = ||R||_2 <= 1``. Every shipped polynomial maps [0, 1] into
[0, 1.2] (quintic) or [0, 2] (Polar Express' first step), so each later ``X`` and ``R`` stays
below 4 in spectral norm; ``B`` and ``P`` are bounded by ``|a| + |b| + |c| <= 49.2``, and
``Q``, a product of at most 3 factors ``P`` between restarts, by 49.2^3 < 1.2e5 in the worst
case and by 8.3 x 4.2 x 4 < 140 for the shipped schedules' leading terms: below fp16's 65504,
with fp32 accumulation inside every GEMM. This holds in exact arithmetic; rounding makes the Gram
``R`` drift away from ``X X^T`` (without restarts it overflows to NaN in fp16), which is what the
restarts bound. fp16 carries 3 more mantissa bits than bf16: 3-7x smaller errors against float64
(benchmarks/results/gram_restarts.md) for the same GEMM work. The Muon step still checks the result
and redoes a bucket in fp32 if it is not finite.

Split by concern: the coefficient schedules, their tuned restarts and the compute dtype live in
:mod:`.newton_schulz_schedules`; how each product is computed (torch, the CPU's blocked symmetric
product, the optional sym_gemm / cuBLASLt families and their switches) in
:mod:`.newton_schulz_gemm`, where a test patches a family. Here: the two iterations, the CPU
workspace they write into, and :func:`orthogonalize`. The schedule names and the GEMM constants
are re-exported, so ``newton_schulz.QUINTIC`` and the like keep working.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar

import torch
from torch import Tensor

from . import newton_schulz_gemm as _gemm
from .newton_schulz_gemm import (  # noqa: F401  (re-exported: tests, benchmarks, cli.env)
    CUBLASLT_ENV,
    SYM_BLOCK_MIN_ROWS,
    SYM_GEMM_DEFAULT_ON,
    SYM_GEMM_ENV,
    _dtype_name,
    _fold_poly,
    _poly,
    _sym_bmm,
    _xxt,
)
from .newton_schulz_schedules import (  # noqa: F401  (re-exported: the old home of these names)
    COEFFICIENT_SCHEDULES,
    GRAM_RESTARTS,
    POLAR_EXPRESS_PUBLISHED,
    QUINTIC,
    _iter_coefficients,
    gram_restarts,
    polar_express_coefficients,
    resolve_coefficients,
    resolve_compute_dtype,
    schedule_name,
)

__all__ = [
    "COEFFICIENT_SCHEDULES",
    "GRAM_MIN_ASPECT",
    "GRAM_RESTARTS",
    "POLAR_EXPRESS_PUBLISHED",
    "QUINTIC",
    "gram_restarts",
    "Workspace",
    "ns_gram",
    "ns_standard",
    "orthogonalize",
    "polar_express_coefficients",
    "resolve_coefficients",
    "resolve_compute_dtype",
    "schedule_name",
    "workspace_scope",
]

GRAM_MIN_ASPECT = 2.0
"""``n / m`` from which the Gram iteration is used when no per-shape measurement decides (CPU,
or ``SPEEDTRONIC_AUTOTUNE=0``): the MAC counts above break even near n = 1.8 m."""

# Dtypes where ``a`` is folded into B's diagonal (``X <- (B + a I) X``: one plain GEMM, no copy
# of X into the output first, which baddbmm needs). In fp16 the fold costs 1.6-2.1x against fp16
# baddbmm yet stays 3.5-5.6x more accurate than torch's bf16 baddbmm (2.7-3.2e-3 vs 1.1-1.5e-2
# relative to float64, benchmarks/results/gram_restarts.md, "fold" table); in bf16 it would
# double an already large error, so bf16 keeps baddbmm.
_FOLD_DTYPES = (torch.float16, torch.float32, torch.float64)


class Workspace:
    """Buffers the iteration writes its products into, kept from one call to the next (CPU).

    Why: glibc serves an allocation above 32 MiB (the ceiling of its dynamic mmap threshold)
    with a fresh ``mmap``, so every new ``(b, m, n)`` product of a batched Newton-Schulz is
    page-faulted in again and unmapped when freed. On GPT-2 small's Muon set (fp32, one thread)
    the step took 16.0 s, 13.4 s under a 4 GiB ``MALLOC_MMAP_THRESHOLD_`` and 12.3 s with these
    buffers (``benchmarks/results/optimizer_cpu_lean.md`` has the peers side by side). CUDA's
    caching allocator already reuses its blocks, so only the eager CPU step opens a scope.

    :meth:`out` hands back a buffer of the asked shape that holds none of the ``live`` tensors
    (a leading-dimension slice of a larger one serves a smaller batch), allocating one only when
    every buffer of that shape is live. The same sequence of calls therefore reuses the same
    buffers every step; the result of a call lives in the workspace until the next call."""

    def __init__(self) -> None:
        self._pool: dict[tuple, list[Tensor]] = {}

    def out(self, shape: Sequence[int], like: Tensor, live: Sequence[Tensor | None]) -> Tensor:
        """A ``shape`` buffer in ``like``'s dtype and device, sharing storage with no ``live``."""
        key = (tuple(shape[1:]), like.dtype, like.device)
        pool = self._pool.setdefault(key, [])
        busy = {t.untyped_storage().data_ptr() for t in live if t is not None}
        for buf in pool:
            if buf.shape[0] >= shape[0] and buf.untyped_storage().data_ptr() not in busy:
                return buf[:shape[0]]
        buf = torch.empty(tuple(shape), dtype=like.dtype, device=like.device)
        pool.append(buf)
        return buf

    @property
    def nbytes(self) -> int:
        """Bytes held."""
        return sum(b.numel() * b.element_size() for pool in self._pool.values() for b in pool)


_ACTIVE_WORKSPACE: ContextVar[Workspace | None] = ContextVar("ns_workspace", default=None)


@contextmanager
def workspace_scope(ws: Workspace) -> Iterator[None]:
    """Newton-Schulz calls inside write into ``ws`` (through the op's Python body too, so a
    caller keeps calling what :func:`speedtronic.kernels.ops.kernel_or_fallback` returns)."""
    token = _ACTIVE_WORKSPACE.set(ws)
    try:
        yield
    finally:
        _ACTIVE_WORKSPACE.reset(token)


def _buf(ws: Workspace | None, shape: Sequence[int], like: Tensor,
         *live: Tensor | None) -> Tensor | None:
    return None if ws is None else ws.out(shape, like, live)


def ns_standard(X: Tensor, coeffs: Sequence[tuple[float, ...]], transpose_out: bool,
                ws: Workspace | None = None) -> Tensor:
    """Standard NS on ``X (b, m, n)``, ``m <= n``, normalized, in the compute dtype.

    With ``transpose_out`` the result is returned as ``(b, n, m)`` (a tall caller's layout)
    without a transpose copy: ``(B X + a X)^T = X^T B + a X^T`` since ``B`` is symmetric.
    With ``ws`` every product is written into its buffers (``X`` itself is never written)."""
    last = len(coeffs) - 1
    bs, m, n = X.shape
    for k, (a, b, c) in enumerate(coeffs):
        A = _xxt(X, _buf(ws, (bs, m, m), X, X))                   # (b, m, m)
        out_t = k == last and transpose_out
        if out_t:  # cuBLASLt cannot read C = X transposed: the torch route
            X = _ns_iteration(X, A, a, b, c, True, ws)            # (b, n, m)
        else:
            X = _ns_step(X, A, a, b, c, ws)                       # (b, m, n)
    return X


def _ns_step(X: Tensor, A: Tensor, a: float, b: float, c: float,
             ws: Workspace | None) -> Tensor:
    """One wide iteration: ``ns_step_lt`` (2 cuBLASLt calls) where this shape measured it
    faster and matching (CUDA, 16-bit), else the torch route."""
    bs, m, n = X.shape
    return _gemm.NS_STEP_LT.run(f"ns_step_lt {bs}x{m}x{n} {_dtype_name(X)}", X,
                                lambda: _ns_iteration(X, A, a, b, c, False, ws),
                                lambda op: op(X, A, a, b, c))


def _ns_iteration(X: Tensor, A: Tensor, a: float, b: float, c: float, transpose_out: bool,
                  ws: Workspace | None) -> Tensor:
    """``a X + (b A + c A^2) X`` with torch ops, for ``A = X X^T``; ``(b, n, m)`` with
    ``transpose_out``."""
    bs, m, n = X.shape
    out_shape = (bs, n, m) if transpose_out else (bs, m, n)
    if X.dtype in _FOLD_DTYPES:  # X <- (a I + B) X: one plain GEMM, X's copy avoided
        P = _fold_poly(A, a, b, c, _buf(ws, (bs, m, m), X, X, A))  # (b, m, m)
        out = _buf(ws, out_shape, X, X, P)
        return torch.bmm(X.mT, P, out=out) if transpose_out else torch.bmm(P, X, out=out)
    B = _poly(A, b, c, _buf(ws, (bs, m, m), X, X, A))             # (b, m, m)
    out = _buf(ws, out_shape, X, X, B)
    if transpose_out:
        return torch.baddbmm(X.mT, X.mT, B, beta=a, out=out)     # (b, n, m)
    # Not bmm + add_(X, alpha=a) on CPU, though 8-13% faster there in bf16: the add rounds
    # alpha to bf16 (3.4445 -> 3.4375) and the NS error went 1.1e-2 -> 2.0e-2.
    return torch.baddbmm(X, B, X, beta=a, out=out)               # (b, m, n)


def ns_gram(X: Tensor, coeffs: Sequence[tuple[float, ...]], restarts: Sequence[int],
            transpose_out: bool, ws: Workspace | None = None) -> Tensor:
    """Gram NS on ``X (b, m, n)``, ``m <= n``: iterate on ``R = X X^T``, re-forming ``X`` and
    ``R`` after each iteration listed in ``restarts`` (1-based). Same output as
    :func:`ns_standard` up to rounding. ``ws`` as there (four ``(b, m, m)`` buffers)."""
    bs, m, n = X.shape
    sq = (bs, m, m)
    R = _xxt(X, _buf(ws, sq, X, X))                               # (b, m, m)
    Q: Tensor | None = None
    last = len(coeffs) - 1
    for k, (a, b, c) in enumerate(coeffs):
        P = _fold_poly(R, a, b, c, _buf(ws, sq, X, X, R, Q))      # P = a I + b R + c R^2
        # P Q and R P are symmetric only in exact arithmetic (polynomials in one R commute):
        # computing half and mirroring them made the fp32 error 2-5x larger, so full GEMMs.
        Q = P if Q is None else torch.bmm(P, Q, out=_buf(ws, sq, X, X, R, P, Q))  # (b, m, m)
        if k == last:
            break
        if k + 1 in restarts:
            X = torch.bmm(Q, X, out=_buf(ws, (bs, m, n), X, X, Q))  # (b, m, n)
            R = _xxt(X, _buf(ws, sq, X, X))
            Q = None
        else:
            T = torch.bmm(R, P, out=_buf(ws, sq, X, X, R, P, Q))
            R = torch.bmm(P, T, out=_buf(ws, sq, X, X, P, T, Q))
    assert Q is not None
    # Q is a polynomial in R, hence symmetric: (Q X)^T = X^T Q, already a tall caller's layout.
    if transpose_out:
        return torch.bmm(X.mT, Q, out=_buf(ws, (bs, n, m), X, X, Q))
    return torch.bmm(Q, X, out=_buf(ws, (bs, m, n), X, X, Q))


def _auto(X: Tensor, coeffs: list[tuple[float, ...]], restarts: Sequence[int], tall: bool,
          schedule: str | None, ws: Workspace | None) -> Tensor:
    """Standard or Gram for this shape: measured once per shape on CUDA (see
    :mod:`speedtronic.kernels.autotune`), else the aspect rule."""
    from . import autotune  # leaf helper; imported here so CPU-only imports stay light

    b, m, n = X.shape
    default = "gram" if n >= GRAM_MIN_ASPECT * m else "standard"
    dispatch = autotune.active_dispatch()
    if not dispatch.enabled or X.device.type != dispatch.device_type:
        choice = default
    else:
        key = f"newton_schulz {b}x{m}x{n} {str(X.dtype).removeprefix('torch.')} {schedule} " \
              f"{len(coeffs)} steps"
        choice = dispatch.choose(key, {
            "standard": lambda: ns_standard(X, coeffs, transpose_out=tall),
            "gram": lambda: ns_gram(X, coeffs, restarts, transpose_out=tall),
        }, default)
    if choice == "gram":
        return ns_gram(X, coeffs, restarts, transpose_out=tall, ws=ws)
    return ns_standard(X, coeffs, transpose_out=tall, ws=ws)


def frobenius_norm(X: Tensor, *, fp64: bool = True) -> Tensor:
    """``||X||_F`` over the last two dims, ``(b, 1, 1)``, without overflow: accumulated in fp64,
    or, where the device has no fp64 (MPS: "Cannot convert a MPS Tensor to float64"), in fp32
    after dividing by the largest magnitude, so the sum of squares stays below m*n."""
    if fp64:
        return torch.linalg.vector_norm(X, dim=(-2, -1), keepdim=True, dtype=torch.float64)
    scale = X.abs().amax(dim=(-2, -1), keepdim=True).float()                  # (b, 1, 1)
    scale = scale.clamp(min=torch.finfo(torch.float32).tiny)
    return torch.linalg.vector_norm(X.float() / scale, dim=(-2, -1), keepdim=True) * scale


def orthogonalize(G: Tensor, steps: int, coefficients: Sequence[float], eps: float,
                  compute_dtype: torch.dtype | None, method: str = "auto",
                  normalized: bool = False) -> Tensor:
    """The body of ``speedtronic::newton_schulz`` (see its docstring in :mod:`.ops`).

    ``method``: ``"standard"``, ``"gram"`` (standard for untuned coefficients, bf16 or square
    shapes) or ``"auto"`` (on CUDA the faster of the two for this shape, measured once; else
    Gram from aspect :data:`GRAM_MIN_ASPECT` on). ``normalized``: ``G`` is already
    divided by its Frobenius norm (the Muon pre-pass does it), so the three passes of a second
    normalization are skipped. Inside :func:`workspace_scope` (the eager CPU Muon step's, never
    the op's) the products and the result live in that workspace: the result stays valid until
    the next call with it."""
    workspace = _ACTIVE_WORKSPACE.get()
    dtype = resolve_compute_dtype(G.device, G.dtype, compute_dtype)
    X = G if G.dim() == 3 else G.unsqueeze(0)                     # (b, m, n)
    tall = X.size(-2) > X.size(-1)
    if tall:
        X = X.mT                                                  # (b, n, m) view, now wide
    if normalized:
        X = X.to(dtype)                                           # no copy when it already is
    else:
        # Normalization in fp32 (fp64 for fp64 in or out) even when the iteration runs in 16
        # bits. The norm accumulates in fp64: in fp32 its sum of squares overflowed once
        # ||G||_F passed ~1.8e19 and a finite matrix came out as zeros.
        norm_dtype = torch.float64 if torch.float64 in (dtype, G.dtype) else torch.float32
        norm = frobenius_norm(X, fp64=X.device.type != "mps")              # (b, 1, 1)
        X = (X.to(norm_dtype) / norm.clamp(min=eps).to(norm_dtype)).to(dtype)  # G untouched
    coeffs = _iter_coefficients(coefficients, steps)
    m, n = X.size(-2), X.size(-1)
    # bf16 stays standard: its Gram error is ~2x standard's (gram_restarts.md, bf16 rows).
    restarts = gram_restarts(coefficients, steps) if dtype in _FOLD_DTYPES else None
    if restarts is None or m >= n or method == "standard":
        X = ns_standard(X, coeffs, transpose_out=tall, ws=workspace)
    elif method == "gram":
        X = ns_gram(X, coeffs, restarts, transpose_out=tall, ws=workspace)
    else:
        X = _auto(X, coeffs, restarts, tall, schedule_name(coefficients, steps), workspace)
    if G.dim() == 2:
        X = X.squeeze(0)
    return X.to(G.dtype).contiguous()                             # G's orientation already
