"""The Speedtronic op registry: every custom op in the ``speedtronic`` namespace.

Each op is defined once here with :func:`torch.library.custom_op` and a fixed schema (the CUDA
kernels in ``csrc/`` implement exactly these schemas). What is registered:

* the pure-PyTorch implementation as the ``CompositeExplicitAutograd`` kernel, i.e. the default
  for every device. A ``TORCH_LIBRARY_IMPL(speedtronic, CUDA, m)`` kernel overrides it on CUDA,
  and the Python API above the ops does not change;
* a fake (meta) implementation so ``torch.compile`` traces the ops without graph breaks;
* mutated arguments marked in the schema (``Tensor(a!)[]``), so functionalization is correct.

Ops (see each function's docstring for the exact math):

``newton_schulz``            odd quintic polar-factor iteration, ``(m, n)`` or ``(b, m, n)``
``muon_plus_normalize``      Muon+ row-then-column L2 normalization (arXiv 2602.21545)
``cautious_mask_``           cautious masking of a list of updates (arXiv 2411.16085)
``muon_pre_orthogonalize_``  momentum EMA + Nesterov + stack + Frobenius normalization
``muon_post_update_``        Muon+ / cautious post-pass + decoupled weight decay + param update
``cautious_adamw_step_``     AdamW (optionally cautious) over lists of tensors
``muon_lean_pre_``           the lean step's pre-pass: every matrix of the step, tensor ``mu``
``muon_lean_update_``        the lean step's weight decay + update, tensor ``lr``/``wd``, guard
                             skip, Muon+ row/column scales
``muon_lean_plus_stats_``    Muon+ inverse row and column norms of every matrix of a step
``muon_lean_cautious_count_`` the cautious mask's kept entries of every matrix of a step

Coefficient schedules for ``newton_schulz`` are named in :data:`COEFFICIENT_SCHEDULES` and
resolved with :func:`resolve_coefficients`.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from . import extension as _kernels
from . import newton_schulz as _ns
from .newton_schulz import (
    COEFFICIENT_SCHEDULES,
    POLAR_EXPRESS_PUBLISHED,
    QUINTIC,
    polar_express_coefficients,
    resolve_coefficients,
    resolve_compute_dtype,
)

#: Every custom op defined below.
OP_NAMES: tuple[str, ...] = (
    "newton_schulz",
    "muon_plus_normalize",
    "cautious_mask_",
    "muon_pre_orthogonalize_",
    "muon_post_update_",
    "cautious_adamw_step_",
    "muon_lean_pre_",
    "muon_lean_update_",
    "muon_lean_plus_stats_",
    "muon_lean_cautious_count_",
)

#: The ops with a hand-written CUDA kernel in ``speedtronic._C`` (the extension must register
#: each). ``newton_schulz`` is not one: its CUDA path is cuBLAS GEMMs driven by the same Python
#: body as on the CPU.
CUDA_KERNEL_OPS: tuple[str, ...] = tuple(n for n in OP_NAMES if n != "newton_schulz")

#: Dtypes the CUDA kernels take; other dtypes (float64) run the op's PyTorch implementation.
CUDA_KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

__all__ = [
    "OP_NAMES",
    "CUDA_KERNEL_OPS",
    "CUDA_KERNEL_DTYPES",
    "COEFFICIENT_SCHEDULES",
    "GRAM_MIN_ASPECT",
    "kernel_or_fallback",
    "QUINTIC",
    "POLAR_EXPRESS_PUBLISHED",
    "polar_express_coefficients",
    "resolve_coefficients",
    "resolve_compute_dtype",
    *OP_NAMES,
]

logger = logging.getLogger("speedtronic.ops")
_fallback_logged: set[tuple[str, tuple[str, ...]]] = set()


def kernel_or_fallback(name: str, device: torch.device, dtypes: Sequence[torch.dtype]) -> Callable:
    """The op ``name``, or its PyTorch implementation when a CUDA kernel would be asked for a
    dtype it lacks (float64 params or ``ns_dtype="fp64"``): every documented option works on
    every device, at the fallback's speed, with one log line per op and dtype combination.

    On meta tensors an op with a CUDA kernel is returned as the op (a step counted on meta
    dispatches what the GPU would). Off CUDA and outside ``torch.compile`` it returns the
    Python body itself: the op would run the same body after the dispatcher, whose first
    custom-op call imports ``torch._dynamo`` (0.75 s of a short CPU run)."""
    op = _OPS_BY_NAME[name]
    kind = torch.device(device).type
    if kind == "meta" and name in CUDA_KERNEL_OPS:
        # Meta tensors stand in for the GPU when a step is counted (kernels/counting.py): the
        # op itself, as one dispatch (its fake kernel), is what CUDA would launch
        return op
    if kind != "cuda":
        return op if torch.compiler.is_compiling() else _PYTHON_BODIES[name]
    if name in _PYTORCH_IMPLS and not _kernels.available():
        # no extension, or one the loader turned down (a device arch it lacks, a kernel
        # missing): an imported binary's CUDA kernels are still registered with the dispatcher
        return _PYTORCH_IMPLS[name]
    if all(d in CUDA_KERNEL_DTYPES for d in dtypes):
        return op
    tag = (name, tuple(str(d).removeprefix("torch.") for d in dtypes))
    if tag not in _fallback_logged:
        _fallback_logged.add(tag)
        logger.info("%s: PyTorch implementation for %s (the CUDA kernel takes float32, "
                    "float16 and bfloat16)", name, "/".join(tag[1]))
    return _PYTORCH_IMPLS[name]


# The Newton-Schulz math and its schedules live in kernels.newton_schulz; re-exported here
# because they are part of the op's contract (its ``coefficients`` argument).
GRAM_MIN_ASPECT = _ns.GRAM_MIN_ASPECT


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


# ---------------------------------------------------------------------------------------------
# cautious_mask_
# ---------------------------------------------------------------------------------------------

def _check_mask_args(updates: Sequence[Tensor], grads: Sequence[Tensor]) -> None:
    # Shared by the real and the fake kernel: bad arguments fail while torch.compile traces.
    if len(updates) != len(grads):
        raise ValueError(f"cautious_mask_: {len(updates)} updates but {len(grads)} grads")


def _cautious_mask_impl(updates: Sequence[Tensor], grads: Sequence[Tensor], rescale: bool) -> None:
    _check_mask_args(updates, grads)
    # One tensor at a time: the only temporaries are one mask (and one product) of the
    # largest tensor, never a copy of every parameter.
    for u, g in zip(updates, grads, strict=True):
        mask = (u * g) > 0                                        # bool, u's shape
        u.mul_(mask)
        if rescale:
            # numel / (kept + 1), as a 0-d tensor: no host sync.
            u.mul_(mask.numel() / (mask.sum(dtype=torch.float32) + 1))


@torch.library.custom_op("speedtronic::cautious_mask_", mutates_args=("updates",),
                         device_types=None,
                         schema="(Tensor(a!)[] updates, Tensor[] grads, bool rescale=True) -> ()")
def cautious_mask_(updates: Sequence[Tensor], grads: Sequence[Tensor],
                   rescale: bool = True) -> None:
    """Cautious masking in place (Liang et al., arXiv 2411.16085).

    For every pair, zero the entries of ``update`` whose sign disagrees with ``grad``
    (keep where ``update * grad > 0``; ``update`` is the quantity that will be *subtracted*).
    With ``rescale`` the kept entries are multiplied by ``numel / (kept + 1)`` per tensor, the
    paper's ``dim / (nnz + 1)``; ``rescale=False`` is the plain mask."""
    _cautious_mask_impl(updates, grads, rescale)


@cautious_mask_.register_fake
def _(updates, grads, rescale=True):
    _check_mask_args(updates, grads)


# ---------------------------------------------------------------------------------------------
# muon_pre_orthogonalize_
# ---------------------------------------------------------------------------------------------

def _check_same_shape(tensors: Sequence[Tensor], what: str) -> None:
    if len(tensors) == 0:
        raise ValueError(f"{what}: needs at least one tensor")
    shape = tensors[0].shape
    if len(shape) != 2 or any(t.shape != shape for t in tensors):
        raise ValueError(f"{what}: all tensors must be 2-D with one shape, got "
                         f"{sorted({tuple(t.shape) for t in tensors})}")


def _check_pre_args(bufs: Sequence[Tensor], grads: Sequence[Tensor]) -> None:
    _check_same_shape(bufs, "muon_pre_orthogonalize_")
    if len(grads) != len(bufs):
        raise ValueError(f"muon_pre_orthogonalize_: {len(bufs)} buffers but {len(grads)} grads")
    for buf in bufs:
        if buf.dtype != torch.float32:
            raise ValueError(f"muon_pre_orthogonalize_: momentum buffers must be float32, got "
                             f"{buf.dtype}")


def _muon_pre_impl(bufs: Sequence[Tensor], grads: Sequence[Tensor], momentum: float,
                   nesterov: bool, eps: float, out_dtype: torch.dtype) -> Tensor:
    _check_pre_args(bufs, grads)
    m, n = bufs[0].shape
    out = torch.empty((len(bufs), m, n), dtype=torch.float32, device=bufs[0].device)  # (b, m, n)
    views = list(out.unbind(0))
    torch._foreach_copy_(views, list(grads))                      # g in fp32
    torch._foreach_lerp_(list(bufs), views, 1.0 - momentum)       # B <- mu B + (1 - mu) g
    if nesterov:
        torch._foreach_lerp_(views, list(bufs), momentum)         # g + mu (B - g)
    else:
        torch._foreach_copy_(views, list(bufs))
    norm = torch.linalg.vector_norm(out, dim=(-2, -1), keepdim=True)  # (b, 1, 1)
    out.div_(norm.clamp_(min=eps))  # torch.optim.Muon's max(||U||, eps), not ||U|| + eps
    return out if out_dtype == torch.float32 else out.to(out_dtype)


@torch.library.custom_op(
    "speedtronic::muon_pre_orthogonalize_", mutates_args=("momentum_buffers",), device_types=None,
    schema="(Tensor(a!)[] momentum_buffers, Tensor[] grads, float momentum, bool nesterov, "
           "float eps, ScalarType out_dtype) -> Tensor")
def muon_pre_orthogonalize_(momentum_buffers: Sequence[Tensor], grads: Sequence[Tensor],
                            momentum: float, nesterov: bool, eps: float,
                            out_dtype: torch.dtype) -> Tensor:
    """Muon's pre-orthogonalization pass for ``b`` same-shape ``(m, n)`` matrices.

    Updates the fp32 momentum buffers in place as torch.optim.Muon does (an EMA,
    ``B <- mu B + (1 - mu) g``), forms the Nesterov update ``g + mu (B - g)`` (or ``B``), stacks
    the updates into a new ``(b, m, n)`` tensor of ``out_dtype`` and divides each matrix by
    ``max(||.||_F, eps)`` (torch.optim.Muon's clamp). Gradients may be any float dtype; the
    math is fp32."""
    return _muon_pre_impl(momentum_buffers, grads, momentum, nesterov, eps, out_dtype)


@muon_pre_orthogonalize_.register_fake
def _(momentum_buffers, grads, momentum, nesterov, eps, out_dtype):
    _check_pre_args(momentum_buffers, grads)
    m, n = momentum_buffers[0].shape
    return momentum_buffers[0].new_empty((len(momentum_buffers), m, n), dtype=out_dtype)


# ---------------------------------------------------------------------------------------------
# muon_post_update_
# ---------------------------------------------------------------------------------------------

def _check_post_args(params: Sequence[Tensor], orth: Tensor, grads: Sequence[Tensor],
                     cautious: bool) -> None:
    if orth.dim() != 3 or orth.size(0) != len(params):
        raise ValueError(f"muon_post_update_: orthogonalized must be (b, m, n) with b="
                         f"{len(params)}, got {tuple(orth.shape)}")
    if cautious:
        _check_mask_args(params, grads)


def _muon_post_impl(params: Sequence[Tensor], orth: Tensor, grads: Sequence[Tensor], lr: float,
                    weight_decay: float, lr_scale: float, muon_plus: bool, norm_eps: float,
                    cautious: bool, cautious_rescale: bool) -> None:
    _check_post_args(params, orth, grads, cautious)
    if muon_plus:
        upd = _muon_plus_impl(orth.float(), norm_eps)             # fresh fp32 (b, m, n)
    elif cautious or orth.dtype != torch.float32:
        upd = orth.float() if orth.dtype != torch.float32 else orth.clone()
    else:
        upd = orth                                                # read-only use below
    views = list(upd.unbind(0))
    if cautious:
        _cautious_mask_impl(views, grads, cautious_rescale)
    _decay_and_add_(list(params), views, 1.0 - lr * weight_decay, -lr * lr_scale)


def _decay_and_add_(params: list[Tensor], updates: Sequence[Tensor], decay: float | Tensor,
                    alpha: float | Tensor) -> None:
    """``p <- p * decay + alpha * u`` with fp32 math whatever the parameter dtype.

    torch's foreach ops round a Python scalar to the tensor's dtype: on a bf16 parameter,
    ``decay = 0.998`` became 0.996 (twice the intended weight decay) and any decay closer to 1
    than ~0.002 became exactly 1.0 (no decay at all). Low-precision parameters are therefore
    updated through an fp32 copy and rounded once, as the CUDA kernels do. ``decay`` and
    ``alpha`` may be 0-d tensors (a tensor lr traced by torch.compile)."""
    if isinstance(decay, Tensor) or isinstance(alpha, Tensor):
        # no `decay != 1.0` test (a data-dependent branch) and no alpha= (Python scalars only)
        for i, q in enumerate(params):
            q32 = q if q.dtype in (torch.float32, torch.float64) else q.float()
            q32.mul_(decay).add_(updates[i].to(q32.dtype) * alpha)
            if q32 is not q:
                q.copy_(q32)
        return
    full = [i for i, q in enumerate(params) if q.dtype in (torch.float32, torch.float64)]
    if full:
        fp = [params[i] for i in full]
        if decay != 1.0:
            torch._foreach_mul_(fp, decay)
        torch._foreach_add_(fp, [updates[i] for i in full], alpha=alpha)
    for i, q in enumerate(params):
        if q.dtype in (torch.float32, torch.float64):
            continue
        q32 = q.float()
        if decay != 1.0:
            q32.mul_(decay)
        q32.add_(updates[i].float(), alpha=alpha)
        q.copy_(q32)


@torch.library.custom_op(
    "speedtronic::muon_post_update_", mutates_args=("params",), device_types=None,
    schema="(Tensor(a!)[] params, Tensor orthogonalized, Tensor[] grads, float lr, "
           "float weight_decay, float lr_scale, bool muon_plus, float norm_eps, bool cautious, "
           "bool cautious_rescale) -> ()")
def muon_post_update_(params: Sequence[Tensor], orthogonalized: Tensor, grads: Sequence[Tensor],
                      lr: float, weight_decay: float, lr_scale: float, muon_plus: bool,
                      norm_eps: float, cautious: bool, cautious_rescale: bool) -> None:
    """Muon's post-orthogonalization pass for ``b`` same-shape parameters.

    ``params[i] <- params[i] * (1 - lr * weight_decay) - lr * lr_scale * post(orth[i])`` where
    ``post`` applies, in order, the Muon+ row-then-column normalization (if ``muon_plus``) and
    the cautious mask against ``grads[i]`` (if ``cautious``; rescaled per matrix by
    ``numel / (kept + 1)`` if ``cautious_rescale``). Weight decay uses the unscaled ``lr`` as in
    torch.optim.Muon. Math in fp32; ``orthogonalized`` is not modified."""
    _muon_post_impl(params, orthogonalized, grads, lr, weight_decay, lr_scale, muon_plus,
                    norm_eps, cautious, cautious_rescale)


@muon_post_update_.register_fake
def _(params, orthogonalized, grads, lr, weight_decay, lr_scale, muon_plus, norm_eps, cautious,
      cautious_rescale):
    _check_post_args(params, orthogonalized, grads, cautious)


# ---------------------------------------------------------------------------------------------
# muon_lean_pre_ / muon_lean_update_: the lean step's passes, every matrix of the step per call
# ---------------------------------------------------------------------------------------------

def _check_lean_pre_args(grads, momenta, outs, grad_copies, mus, mu_index, nesterov, eps) -> None:
    n = len(grads)
    lengths = (len(momenta), len(outs), len(mu_index), len(nesterov), len(eps))
    if any(k != n for k in lengths) or len(grad_copies) not in (0, n):
        raise ValueError("muon_lean_pre_: grads, momenta, outs, mu_index, nesterov, eps (and "
                         f"grad_copies unless empty) must have one entry per matrix; got {n}, "
                         f"{', '.join(map(str, lengths))} ({len(grad_copies)})")
    for i, g in enumerate(grads):
        dense = [("momenta", momenta[i]), ("outs", outs[i])]
        dense += [("grad_copies", grad_copies[i])] if grad_copies else []
        for what, t in dense:
            if t.shape != g.shape or g.dim() != 2 or not t.is_contiguous():
                raise ValueError(f"muon_lean_pre_: {what}[{i}] must be a contiguous "
                                 f"{tuple(g.shape)} tensor, got {tuple(t.shape)}")
        if momenta[i].dtype != torch.float32:
            raise ValueError(f"muon_lean_pre_: momenta must be float32, got {momenta[i].dtype}")
        if not 0 <= mu_index[i] < len(mus):
            raise ValueError(f"muon_lean_pre_: mu_index[{i}] = {mu_index[i]} is out of range for "
                             f"{len(mus)} entries")


def _lean_pre_impl(grads: Sequence[Tensor], momenta: Sequence[Tensor], outs: Sequence[Tensor],
                   grad_copies: Sequence[Tensor], mus: Sequence[Tensor], mu_index: Sequence[int],
                   nesterov: Sequence[int], eps: Sequence[float]) -> None:
    _check_lean_pre_args(grads, momenta, outs, grad_copies, mus, mu_index, nesterov, eps)
    for i, g in enumerate(grads):
        g32, M, mu = g.float(), momenta[i], mus[mu_index[i]]
        torch.lerp(g32, M, mu, out=M)                             # M <- mu M + (1 - mu) g
        U = torch.lerp(g32, M, mu) if nesterov[i] else M          # g + mu (M - g)
        outs[i].copy_(U / torch.linalg.vector_norm(U).clamp(min=eps[i]))
        if grad_copies:
            grad_copies[i].copy_(g32)


@torch.library.custom_op(
    "speedtronic::muon_lean_pre_", mutates_args=("momenta", "outs", "grad_copies"),
    device_types=None,
    schema="(Tensor[] grads, Tensor(a!)[] momenta, Tensor(b!)[] outs, Tensor(c!)[] grad_copies, "
           "Tensor[] mus, int[] mu_index, int[] nesterov, float[] eps) -> ()")
def muon_lean_pre_(grads: Sequence[Tensor], momenta: Sequence[Tensor], outs: Sequence[Tensor],
                   grad_copies: Sequence[Tensor], mus: Sequence[Tensor], mu_index: Sequence[int],
                   nesterov: Sequence[int], eps: Sequence[float]) -> None:
    """The lean Muon step's pre-pass over every matrix of a step, whatever its shape group.

    For matrix ``i`` (``grads[i]`` any 2-D strided view in the Newton-Schulz orientation, any
    float dtype; ``momenta[i]``, ``outs[i]`` and ``grad_copies[i]`` dense of the same shape):
    ``M <- mu M + (1 - mu) g`` in fp32 with ``mu = mus[mu_index[i]]`` (a 0-d fp32 tensor, read
    on the device), ``U = g + mu (M - g)`` with ``nesterov[i]`` else ``M``, and
    ``outs[i] = U / max(||U||_F, eps[i])`` in ``outs[i]``'s dtype; ``grad_copies`` (empty, or
    one per matrix) receive ``g`` in fp32. CUDA: 2 launches per 128 matrices of one dtype pair."""
    _lean_pre_impl(grads, momenta, outs, grad_copies, mus, mu_index, nesterov, eps)


@muon_lean_pre_.register_fake
def _(grads, momenta, outs, grad_copies, mus, mu_index, nesterov, eps):
    _check_lean_pre_args(grads, momenta, outs, grad_copies, mus, mu_index, nesterov, eps)


def _check_scale(s: Tensor, length: int, what: str, i: int, op: str) -> None:
    if s.dim() != 1 or s.shape[0] != length or s.dtype != torch.float32 or not s.is_contiguous():
        raise ValueError(f"{op}: {what}[{i}] must be a contiguous float32 tensor of {length} "
                         f"entries, got {s.dtype} {tuple(s.shape)}")


def _check_cautious_grad(g: Tensor, u: Tensor, i: int, op: str) -> bool:
    """A cautious gradient: fp32 with the update's shape and strides; empty: no mask."""
    if g.numel() == 0:
        return False
    if g.dtype != torch.float32 or g.shape != u.shape or g.stride() != u.stride():
        raise ValueError(f"{op}: grads[{i}] must be float32 with updates[{i}]'s shape "
                         f"{tuple(u.shape)} and strides {u.stride()}, got {g.dtype} "
                         f"{tuple(g.shape)} strides {g.stride()}")
    return True


def _check_lean_update_args(params, updates, lrs, weight_decays, hyper_index, scales, skip,
                            skip_index, row_scales, col_scales, grads=(), kept=None,
                            kept_index=()) -> None:
    n = len(params)
    lengths = (len(updates), len(hyper_index), len(scales), len(skip_index))
    if any(k != n for k in lengths):
        raise ValueError("muon_lean_update_: params, updates, hyper_index, scales and skip_index "
                         f"must have one entry per matrix; got {n}, {', '.join(map(str, lengths))}")
    if len(row_scales) != len(col_scales) or len(row_scales) not in (0, n):
        raise ValueError("muon_lean_update_: row_scales and col_scales must both be empty or have "
                         f"one entry per matrix; got {len(row_scales)} and {len(col_scales)} "
                         f"for {n}")
    if len(grads) not in (0, n) or len(kept_index) not in (0, n):
        raise ValueError("muon_lean_update_: grads and kept_index must be empty or have one entry "
                         f"per matrix; got {len(grads)} and {len(kept_index)} for {n}")
    for i, u in enumerate(updates if grads else []):
        k = kept_index[i] if kept_index else -1
        if _check_cautious_grad(grads[i], u, i, "muon_lean_update_") and k >= 0:
            if kept is None or not 0 <= k < kept.shape[0]:
                raise ValueError(f"muon_lean_update_: kept_index[{i}] = {k} is out of range for "
                                 f"{0 if kept is None else kept.shape[0]} entries")
    for i, u in enumerate(updates if row_scales else []):
        if row_scales[i].numel() == 0 and col_scales[i].numel() == 0:
            continue  # no Muon+ for this matrix
        _check_scale(row_scales[i], u.shape[0], "row_scales", i, "muon_lean_update_")
        _check_scale(col_scales[i], u.shape[1], "col_scales", i, "muon_lean_update_")
    if len(lrs) != len(weight_decays):
        raise ValueError(f"muon_lean_update_: {len(lrs)} lrs but {len(weight_decays)} "
                         "weight_decays")
    for i, p in enumerate(params):
        if p.dim() != 2 or updates[i].shape != p.shape:
            raise ValueError(f"muon_lean_update_: updates[{i}] must match params[{i}] "
                             f"({tuple(p.shape)}), got {tuple(updates[i].shape)}")
        if not 0 <= hyper_index[i] < len(lrs):
            raise ValueError(f"muon_lean_update_: hyper_index[{i}] = {hyper_index[i]} is out of "
                             f"range for {len(lrs)} entries")
        size = 0 if skip is None else skip.shape[0]
        if not (skip_index[i] == -1 or 0 <= skip_index[i] < size):
            raise ValueError(f"muon_lean_update_: skip_index[{i}] = {skip_index[i]} is out of "
                             f"range for {size} entries")


def _lean_update_impl(params: Sequence[Tensor], updates: Sequence[Tensor], lrs: Sequence[Tensor],
                      weight_decays: Sequence[Tensor], hyper_index: Sequence[int],
                      scales: Sequence[float], skip: Tensor | None, skip_index: Sequence[int],
                      row_scales: Sequence[Tensor], col_scales: Sequence[Tensor],
                      grads: Sequence[Tensor], kept: Tensor | None,
                      kept_index: Sequence[int]) -> None:
    _check_lean_update_args(params, updates, lrs, weight_decays, hyper_index, scales, skip,
                            skip_index, row_scales, col_scales, grads, kept, kept_index)
    for i, p in enumerate(params):
        lr, wd = lrs[hyper_index[i]], weight_decays[hyper_index[i]]
        u = updates[i].float()                                    # (r, c) fp32
        keep = (u * grads[i]) > 0 if grads and grads[i].numel() else None  # the count's test
        if row_scales and row_scales[i].numel():                  # Muon+: (U r) c, as its op
            u = u * row_scales[i][:, None] * col_scales[i][None, :]
        if keep is not None:                                      # cautious: mask, rescale
            if kept_index and kept_index[i] >= 0:
                u = u * (u.numel() / (kept[kept_index[i]].float() + 1))
            u = u * keep
        step = (u * lr).to(p.dtype)                               # lr U, rounded to p's dtype
        if skip_index[i] >= 0:
            step = step.masked_fill(skip[skip_index[i]], 0)
        p.mul_(torch.addcmul(torch.ones_like(lr), lr, wd, value=-1.0))  # p (1 - lr wd)
        p.add_(step, alpha=-scales[i])


@torch.library.custom_op(
    "speedtronic::muon_lean_update_", mutates_args=("params",), device_types=None,
    schema="(Tensor(a!)[] params, Tensor[] updates, Tensor[] lrs, Tensor[] weight_decays, "
           "int[] hyper_index, float[] scales, Tensor? skip, int[] skip_index, "
           "Tensor[] row_scales, Tensor[] col_scales, Tensor[] grads, Tensor? kept, "
           "int[] kept_index) -> ()")
def muon_lean_update_(params: Sequence[Tensor], updates: Sequence[Tensor], lrs: Sequence[Tensor],
                      weight_decays: Sequence[Tensor], hyper_index: Sequence[int],
                      scales: Sequence[float], skip: Tensor | None, skip_index: Sequence[int],
                      row_scales: Sequence[Tensor], col_scales: Sequence[Tensor],
                      grads: Sequence[Tensor], kept: Tensor | None,
                      kept_index: Sequence[int]) -> None:
    """The lean Muon step's decoupled weight decay and update over every matrix of a step.

    ``p <- p (1 - lr wd) - scales[i] * (lr U)`` for ``p = params[i]`` (2-D, any strides) and
    ``U = updates[i]`` (its shape, any strides and float dtype), with ``lr``/``wd`` the 0-d
    fp32 tensors ``lrs[hyper_index[i]]`` / ``weight_decays[hyper_index[i]]`` read on the device;
    each product is rounded to ``p``'s dtype as the multi-tensor torch ops round it. When
    ``skip_index[i] >= 0`` and ``skip[skip_index[i]]`` (a bool tensor: the 16-bit guard's
    verdict) is true, the update is dropped and the decay kept. ``row_scales`` / ``col_scales``
    (both empty, or one fp32 vector per matrix of ``U``'s row / column count: Muon+, from
    :func:`muon_lean_plus_stats_`; a pair of empty tensors: none for that matrix) scale ``U`` to
    ``(U_rc row_scales[r]) col_scales[c]`` in fp32 first. ``grads`` (empty, or one per matrix:
    fp32 with ``U``'s shape and strides; an empty tensor: none) is the cautious mask: entries
    where ``U * g <= 0`` (tested before the Muon+ scales, as
    :func:`muon_lean_cautious_count_` counts) are dropped, and with ``kept_index[i] >= 0`` the
    rest are multiplied by ``numel / (kept[kept_index[i]] + 1)``. CUDA: 1 launch per 128
    matrices of one dtype pair."""
    _lean_update_impl(params, updates, lrs, weight_decays, hyper_index, scales, skip, skip_index,
                      row_scales, col_scales, grads, kept, kept_index)


@muon_lean_update_.register_fake
def _(params, updates, lrs, weight_decays, hyper_index, scales, skip, skip_index, row_scales,
      col_scales, grads, kept, kept_index):
    _check_lean_update_args(params, updates, lrs, weight_decays, hyper_index, scales, skip,
                            skip_index, row_scales, col_scales, grads, kept, kept_index)


def _check_lean_count_args(updates, grads, kept) -> None:
    if len(grads) != len(updates):
        raise ValueError(f"muon_lean_cautious_count_: {len(updates)} updates but {len(grads)} "
                         "grads")
    if kept.dim() != 1 or kept.dtype != torch.int64 or kept.shape[0] != len(updates):
        raise ValueError("muon_lean_cautious_count_: kept must be a 1-D int64 tensor of "
                         f"{len(updates)} entries, got {kept.dtype} {tuple(kept.shape)}")
    for i, u in enumerate(updates):
        if u.dim() != 2:
            raise ValueError(f"muon_lean_cautious_count_: updates[{i}] must be 2-D, got "
                             f"{tuple(u.shape)}")
        if not _check_cautious_grad(grads[i], u, i, "muon_lean_cautious_count_") and u.numel():
            raise ValueError(f"muon_lean_cautious_count_: grads[{i}] is empty")


def _lean_cautious_count_impl(updates: Sequence[Tensor], grads: Sequence[Tensor],
                              kept: Tensor) -> None:
    _check_lean_count_args(updates, grads, kept)
    for i, u in enumerate(updates):
        kept[i] = ((u.float() * grads[i]) > 0).sum()


@torch.library.custom_op(
    "speedtronic::muon_lean_cautious_count_", mutates_args=("kept",), device_types=None,
    schema="(Tensor[] updates, Tensor[] grads, Tensor(a!) kept) -> ()")
def muon_lean_cautious_count_(updates: Sequence[Tensor], grads: Sequence[Tensor],
                              kept: Tensor) -> None:
    """The cautious mask's count for every matrix of a step, for :func:`muon_lean_update_`'s
    rescale: ``kept[i]`` (int64) = the entries where ``updates[i] * grads[i] > 0`` (``grads[i]``
    fp32 with ``updates[i]``'s shape and strides). CUDA: 1 launch to zero ``kept``, then 1 per
    128 matrices of one dtype (integer atomics: exact in any order)."""
    _lean_cautious_count_impl(updates, grads, kept)


@muon_lean_cautious_count_.register_fake
def _(updates, grads, kept):
    _check_lean_count_args(updates, grads, kept)


def _check_lean_plus_stats_args(updates, row_scales, col_scales, eps) -> None:
    n = len(updates)
    if not len(row_scales) == len(col_scales) == len(eps) == n:
        raise ValueError("muon_lean_plus_stats_: updates, row_scales, col_scales and eps must "
                         f"have one entry per matrix; got {n}, {len(row_scales)}, "
                         f"{len(col_scales)}, {len(eps)}")
    for i, u in enumerate(updates):
        if u.dim() != 2:
            raise ValueError(f"muon_lean_plus_stats_: updates[{i}] must be 2-D, got "
                             f"{tuple(u.shape)}")
        _check_scale(row_scales[i], u.shape[0], "row_scales", i, "muon_lean_plus_stats_")
        _check_scale(col_scales[i], u.shape[1], "col_scales", i, "muon_lean_plus_stats_")


def _lean_plus_stats_impl(updates: Sequence[Tensor], row_scales: Sequence[Tensor],
                          col_scales: Sequence[Tensor], eps: Sequence[float]) -> None:
    _check_lean_plus_stats_args(updates, row_scales, col_scales, eps)
    for i, U in enumerate(updates):
        u = U.float()                                                     # (r, c) fp32
        rows = u.square().sum(dim=-1).add_(eps[i]).rsqrt_()              # (r,)
        cols = (u * rows[:, None]).square().sum(dim=-2).add_(eps[i]).rsqrt_()  # (c,)
        row_scales[i].copy_(rows)
        col_scales[i].copy_(cols)


@torch.library.custom_op(
    "speedtronic::muon_lean_plus_stats_", mutates_args=("row_scales", "col_scales"),
    device_types=None,
    schema="(Tensor[] updates, Tensor(a!)[] row_scales, Tensor(b!)[] col_scales, "
           "float[] eps) -> ()")
def muon_lean_plus_stats_(updates: Sequence[Tensor], row_scales: Sequence[Tensor],
                          col_scales: Sequence[Tensor], eps: Sequence[float]) -> None:
    """Muon+'s statistics for every matrix of a step, applied later by
    :func:`muon_lean_update_`: for ``U = updates[i]`` (2-D, any strides and float dtype, in the
    orientation whose rows Muon+ normalizes first) ``row_scales[i][r] = 1 / sqrt(sum_c U_rc^2 +
    eps[i])`` and ``col_scales[i][c] = 1 / sqrt(sum_r (U_rc row_scales[i][r])^2 + eps[i])``, fp32.
    ``(U r) c`` is :func:`muon_plus_normalize` of ``U``. CUDA: 4 launches per 128 matrices of
    one dtype (row partials, rows, column partials, columns)."""
    _lean_plus_stats_impl(updates, row_scales, col_scales, eps)


@muon_lean_plus_stats_.register_fake
def _(updates, row_scales, col_scales, eps):
    _check_lean_plus_stats_args(updates, row_scales, col_scales, eps)


# ---------------------------------------------------------------------------------------------
# cautious_adamw_step_
# ---------------------------------------------------------------------------------------------

# Tensors are processed in chunks of at most this many elements so the update temporaries stay
# bounded (16 MiB of fp32) instead of one copy of every parameter.
_ADAMW_CHUNK_NUMEL = 1 << 22


def _chunks(n_items: int, numels: Sequence[int]) -> list[range]:
    out, start, total = [], 0, 0
    for i in range(n_items):
        if i > start and total + numels[i] > _ADAMW_CHUNK_NUMEL:
            out.append(range(start, i))
            start, total = i, 0
        total += numels[i]
    if n_items:
        out.append(range(start, n_items))
    return out


def _check_adamw_args(params, grads, exp_avgs, exp_avg_sqs, step) -> None:
    if not (len(grads) == len(exp_avgs) == len(exp_avg_sqs) == len(params)):
        raise ValueError("cautious_adamw_step_: params, grads, exp_avgs and exp_avg_sqs must have "
                         "the same length")
    if not isinstance(step, Tensor) and step < 1:
        raise ValueError(f"cautious_adamw_step_: step must be >= 1 (1-based), got {step}")


def _adamw_impl(params, grads, exp_avgs, exp_avg_sqs, lr, beta1, beta2, eps, weight_decay, step,
                cautious, cautious_rescale) -> None:
    n = len(params)
    _check_adamw_args(params, grads, exp_avgs, exp_avg_sqs, step)
    traced = isinstance(step, Tensor)  # a 0-d step tensor: see adamw_traceable
    bias1 = 1.0 - beta1 ** step
    bias2_sqrt = (1.0 - beta2 ** step).sqrt() if traced else math.sqrt(1.0 - beta2 ** step)
    for idx in _chunks(n, [p.numel() for p in params]):
        p = [params[i] for i in idx]
        g = [grads[i] for i in idx]
        m = [exp_avgs[i] for i in idx]
        v = [exp_avg_sqs[i] for i in idx]
        # State may be fp32 beside bf16/fp16 params and grads: lerp needs matching dtypes.
        g = [gi if gi.dtype == mi.dtype else gi.to(mi.dtype) for gi, mi in zip(g, m, strict=True)]
        torch._foreach_lerp_(m, g, 1.0 - beta1)                   # m <- b1 m + (1 - b1) g
        torch._foreach_mul_(v, beta2)
        torch._foreach_addcmul_(v, g, g, 1.0 - beta2)             # v <- b2 v + (1 - b2) g^2
        # The direction in fp32 for 16-bit state, as the CUDA kernel computes it: eps = 1e-8 is 0
        # in fp16, so an entry with v = m = 0 gave 1 / sqrt(0) * 0 = NaN (a cautious fp16 model
        # was all NaN after 2 steps).
        upd = torch._foreach_sqrt([vi.float() if vi.dtype in (torch.float16, torch.bfloat16)
                                   else vi for vi in v])          # fresh tensors, never v itself
        torch._foreach_div_(upd, bias2_sqrt)
        torch._foreach_add_(upd, eps)
        torch._foreach_reciprocal_(upd)
        torch._foreach_mul_(upd, m)                               # m / (sqrt(v_hat) + eps)
        if cautious:
            _cautious_mask_impl(upd, g, cautious_rescale)
        if traced:
            torch._foreach_div_(upd, bias1)
        _decay_and_add_(p, upd, 1.0 - lr * weight_decay, -lr if traced else -lr / bias1)


def adamw_traceable(params: Sequence[Tensor], grads: Sequence[Tensor],
                    exp_avgs: Sequence[Tensor], exp_avg_sqs: Sequence[Tensor], lr: float,
                    beta1: float, beta2: float, eps: float, weight_decay: float, step: Tensor,
                    cautious: bool, cautious_rescale: bool) -> None:
    """The math of :func:`cautious_adamw_step_` with ``step`` a 0-d tensor, called directly
    (not as an op) so that ``torch.compile`` traces it: the op takes ``step`` as an int, and
    reading it from the state tensor (``.item()``) would break the graph every step."""
    _adamw_impl(params, grads, exp_avgs, exp_avg_sqs, lr, beta1, beta2, eps, weight_decay, step,
                cautious, cautious_rescale)


@torch.library.custom_op(
    "speedtronic::cautious_adamw_step_", mutates_args=("params", "exp_avgs", "exp_avg_sqs"),
    device_types=None,
    schema="(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, Tensor(c!)[] exp_avg_sqs, "
           "float lr, float beta1, float beta2, float eps, float weight_decay, int step, "
           "bool cautious, bool cautious_rescale) -> ()")
def cautious_adamw_step_(params: Sequence[Tensor], grads: Sequence[Tensor],
                         exp_avgs: Sequence[Tensor], exp_avg_sqs: Sequence[Tensor], lr: float,
                         beta1: float, beta2: float, eps: float, weight_decay: float, step: int,
                         cautious: bool, cautious_rescale: bool) -> None:
    """One AdamW step (decoupled weight decay, bias-corrected, ``step`` is 1-based) over lists,
    optionally cautious: the Adam direction ``u = m_hat / (sqrt(v_hat) + eps)`` is masked where
    ``u * g <= 0`` (and rescaled by ``numel / (kept + 1)`` if ``cautious_rescale``) before
    ``p <- p (1 - lr wd) - lr u``. Weight decay is not masked (C-AdamW)."""
    _adamw_impl(params, grads, exp_avgs, exp_avg_sqs, lr, beta1, beta2, eps, weight_decay, step,
                cautious, cautious_rescale)


@cautious_adamw_step_.register_fake
def _(params, grads, exp_avgs, exp_avg_sqs, lr, beta1, beta2, eps, weight_decay, step, cautious,
      cautious_rescale):
    _check_adamw_args(params, grads, exp_avgs, exp_avg_sqs, step)


# CUDA implementations of the ops above (speedtronic._C), registered when available; otherwise
# one "cuda kernels: fallback: <reason>" line is logged and the defaults above run everywhere.
# Loaded only now, after every schema above exists, so the CUDA impls attach to defined ops.
_kernels.load(op_names=CUDA_KERNEL_OPS)

# A plain dict, not globals(): torch.compile cannot trace globals() (a graph break per call).
_OPS_BY_NAME: dict[str, Callable] = {name: globals()[name] for name in OP_NAMES}

#: The pure-PyTorch body of each op with a CUDA kernel (what :func:`kernel_or_fallback` returns).
_PYTORCH_IMPLS: dict[str, Callable] = {
    "muon_plus_normalize": _muon_plus_impl,
    "cautious_mask_": _cautious_mask_impl,
    "muon_pre_orthogonalize_": _muon_pre_impl,
    "muon_post_update_": _muon_post_impl,
    "cautious_adamw_step_": _adamw_impl,
    "muon_lean_pre_": _lean_pre_impl,
    "muon_lean_update_": _lean_update_impl,
    "muon_lean_plus_stats_": _lean_plus_stats_impl,
    "muon_lean_cautious_count_": _lean_cautious_count_impl,
}

# Every op's Python body, called directly off CUDA (see kernel_or_fallback); under no_grad, as
# the dispatcher runs a custom op's body (so it may update leaf parameters in place).
_PYTHON_BODIES: dict[str, Callable] = {
    name: torch.no_grad()(fn)
    for name, fn in {**_PYTORCH_IMPLS, "newton_schulz": _newton_schulz_impl}.items()}
