"""Newton-Schulz orthogonalization: coefficient schedules, the standard and the Gram iteration.

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
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar

import torch
from torch import Tensor

from .choice import TOLERANCE_16BIT, MeasuredKernel, debug_op

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

QUINTIC: tuple[float, float, float] = (3.4445, -4.7750, 2.0315)
"""Keller Jordan's quintic (a, b, c), the same every iteration (torch.optim.Muon's default)."""

# Published per-iteration (a, b, c) of Polar Express, degree 5 (Amsel, Persson, Musco, Gower,
# arXiv 2505.16932, Algorithm 1). Iterations past the 8th repeat the last entry, which is the
# limit polynomial (15x - 10x^3 + 3x^5)/8 rescaled. The paper divides every entry but the last by
# the safety factor 1.01 (a/1.01, b/1.01^3, c/1.01^5) and normalizes by 1.01*||X||_F.
POLAR_EXPRESS_PUBLISHED: tuple[tuple[float, float, float], ...] = (
    (8.28721201814563, -23.595886519098837, 17.300387312530933),
    (4.107059111542203, -2.9478499167379106, 0.5448431082926601),
    (3.9486908534822946, -2.908902115962949, 0.5518191394370137),
    (3.3184196573706015, -2.488488024314874, 0.51004894012372),
    (2.300652019954817, -1.6689039845747493, 0.4188073119525673),
    (1.891301407787398, -1.2679958271945868, 0.37680408948524835),
    (1.8750014808534479, -1.2500016453999487, 0.3750001645474248),
    (1.875, -1.25, 0.375),
)
_PE_SAFETY = 1.01

COEFFICIENT_SCHEDULES = ("quintic", "polar_express")
"""Names accepted wherever Newton-Schulz coefficients are configured."""

GRAM_RESTARTS: dict[str, tuple[int, ...]] = {"quintic": (2,), "polar_express": (1, 2)}
"""Per schedule, the iterations (1-based) after which the Gram iteration re-forms ``X = Q X``
and ``R = X X^T``. Chosen by ``benchmarks/tune_gram_restarts.py``: the fewest restarts whose
error on Gaussian and power-law spectra (aspect 2 to 8, fp16 and fp32, inputs also scaled by
1.05 as a safety margin) stays within 1.25x standard Newton-Schulz in the same dtype
(``benchmarks/results/gram_restarts.md``). Coefficients that match no schedule, and bf16, use
standard NS."""

GRAM_MIN_ASPECT = 2.0
"""``n / m`` from which the Gram iteration is used when no per-shape measurement decides (CPU,
or ``SPEEDTRONIC_AUTOTUNE=0``): the MAC counts above break even near n = 1.8 m."""

# Dtypes where ``a`` is folded into B's diagonal (``X <- (B + a I) X``: one plain GEMM, no copy
# of X into the output first, which baddbmm needs). In fp16 the fold costs 1.6-2.1x against fp16
# baddbmm yet stays 3.5-5.6x more accurate than torch's bf16 baddbmm (2.7-3.2e-3 vs 1.1-1.5e-2
# relative to float64, benchmarks/results/gram_restarts.md, "fold" table); in bf16 it would
# double an already large error, so bf16 keeps baddbmm.
_FOLD_DTYPES = (torch.float16, torch.float32, torch.float64)


def polar_express_coefficients(steps: int) -> list[float]:
    """Flat ``3 * steps`` Polar Express schedule, equivalent to the paper's Algorithm 1.

    The safety factor is applied as published. The paper's extra ``1.01`` in the normalization
    (X / (1.01 ||X||_F)) is folded into the first polynomial: p(x / s) has coefficients
    (a/s, b/s^3, c/s^5), so our ops keep the plain Frobenius normalization.
    """
    if steps < 1:
        raise ValueError(f"polar_express needs steps >= 1, got {steps}")
    s = _PE_SAFETY
    table = [(a / s, b / s**3, c / s**5) for a, b, c in POLAR_EXPRESS_PUBLISHED[:-1]]
    table.append(POLAR_EXPRESS_PUBLISHED[-1])
    table = table[:steps] + [table[-1]] * max(0, steps - len(table))
    a, b, c = table[0]
    table[0] = (a / s, b / s**3, c / s**5)
    return [float(v) for abc in table for v in abc]


def resolve_coefficients(spec: str | Sequence[float], steps: int) -> list[float]:
    """Turn a schedule name or an explicit list into a flat list of 3 or ``3 * steps`` floats.

    ``"quintic"`` gives :data:`QUINTIC` (3 floats, reused every iteration); ``"polar_express"``
    gives :func:`polar_express_coefficients`; a list of 3 or ``3 * steps`` floats is returned as
    floats. Anything else raises ``ValueError`` naming the valid choices.
    """
    if isinstance(spec, str):
        if spec == "quintic":
            return list(QUINTIC)
        if spec == "polar_express":
            return polar_express_coefficients(steps)
        raise ValueError(f"unknown Newton-Schulz coefficient schedule {spec!r}; valid: "
                         f"{', '.join(COEFFICIENT_SCHEDULES)} or a list of 3 or 3*steps floats")
    flat = [float(v) for v in spec]
    if len(flat) not in (3, 3 * steps):
        raise ValueError(f"Newton-Schulz coefficients must hold 3 or 3*steps={3 * steps} floats, "
                         f"got {len(flat)}")
    return flat


def schedule_name(coefficients: Sequence[float], steps: int) -> str | None:
    """The shipped schedule these coefficients are (``"quintic"``, ``"polar_express"``), or None."""
    flat = [float(v) for v in coefficients]
    if flat == list(QUINTIC) or flat == list(QUINTIC) * steps:
        return "quintic"
    if len(flat) == 3 * steps and flat == polar_express_coefficients(steps):
        return "polar_express"
    return None


def gram_restarts(coefficients: Sequence[float], steps: int) -> tuple[int, ...] | None:
    """Restart points for these coefficients, or None when they were not tuned (use standard)."""
    name = schedule_name(coefficients, steps)
    return GRAM_RESTARTS.get(name) if name is not None else None


def resolve_compute_dtype(device: torch.device, dtype: torch.dtype,
                          requested: torch.dtype | None = None) -> torch.dtype:
    """Newton-Schulz matmul dtype: ``requested`` if given; else float64 stays float64, fp16 on CUDA
    (3-7x more accurate than bf16 for the same GEMM work, and overflow-free here: see the module
    docstring), fp32 elsewhere: AVX2-only CPUs have no 16-bit GEMM path and run it tens of times
    slower than fp32 (each CPU benchmark records the machine's flags and GEMM rates, e.g.
    benchmarks/results/optimizer_cpu.md)."""
    if requested is not None:
        return requested
    if dtype == torch.float64:
        return torch.float64
    return torch.float16 if torch.device(device).type == "cuda" else torch.float32


def _iter_coefficients(coefficients: Sequence[float], steps: int) -> list[tuple[float, ...]]:
    flat = [float(v) for v in coefficients]
    if len(flat) == 3:
        return [tuple(flat)] * steps
    return [tuple(flat[3 * k:3 * k + 3]) for k in range(steps)]


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
    return NS_STEP_LT.run(f"ns_step_lt {bs}x{m}x{n} {_dtype_name(X)}", X,
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
        norm = torch.linalg.vector_norm(X, dim=(-2, -1), keepdim=True, dtype=torch.float64)
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
