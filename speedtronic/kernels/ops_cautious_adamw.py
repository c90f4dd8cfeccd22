"""The list-wide update ops: ``cautious_mask_`` (zero the entries whose sign disagrees with the
gradient) and ``cautious_adamw_step_`` (AdamW over lists, optionally cautious), plus the
``p <- p * decay + alpha * u`` both optimizers end a step with.

Schema, fake kernel and PyTorch body of each op side by side; the CUDA kernels are in ``csrc/``.
:mod:`.ops_muon` borrows the mask and ``_decay_and_add_`` for Muon's post-pass. :mod:`.ops`
imports this module, and that import is what registers the ops: use them through :mod:`.ops`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = ["cautious_mask_", "cautious_adamw_step_", "adamw_traceable"]


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
        # fp16's product underflows: 1e-4 * 1e-4 is 0 there (smallest subnormal 6e-8), which
        # dropped agreeing entries of small gradients; the CUDA kernels multiply in fp32 too
        mask = (u.float() * g if u.dtype == torch.float16 else u * g) > 0  # bool, u's shape
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
# _decay_and_add_: the parameter update both muon_post_update_ and cautious_adamw_step_ end with
# ---------------------------------------------------------------------------------------------

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
