"""The classic Muon step's two passes over one shape group of ``b`` same-shape matrices:
``muon_pre_orthogonalize_`` (momentum, Nesterov, stack, Frobenius normalization) before
``newton_schulz``, and ``muon_post_update_`` (Muon+ / cautious, weight decay, parameter update)
after it.

Schema, fake kernel and PyTorch body of each op side by side; the CUDA kernels are in ``csrc/``.
The post-pass reuses the Muon+ body of :mod:`.ops_orthogonalize` and the mask and update of
:mod:`.ops_cautious_adamw`, so the fallback does exactly what those ops do. :mod:`.ops` imports
this module, and that import is what registers the ops: use them through :mod:`.ops`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from .ops_cautious_adamw import _cautious_mask_impl, _check_mask_args, _decay_and_add_
from .ops_orthogonalize import _muon_plus_impl

__all__ = ["muon_pre_orthogonalize_", "muon_post_update_"]


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
