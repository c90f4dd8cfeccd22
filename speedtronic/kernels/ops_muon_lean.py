"""The lean Muon step's passes: each op takes every matrix of a step in one call, whatever its
shape group (mixed shapes, any strides), with ``lr`` / ``wd`` / ``mu`` as device tensors so a
step reads nothing back to the host.

``muon_lean_pre_`` (momentum, Nesterov, Frobenius normalization), ``muon_lean_plus_stats_``
(Muon+'s row and column scales), ``muon_lean_cautious_count_`` (the cautious mask's kept
entries) and ``muon_lean_update_`` (weight decay and the update, applying those scales, the mask
and the 16-bit guard's skip). Schema, fake kernel and PyTorch body of each op side by side; the
CUDA kernels are in ``csrc/``. :mod:`.ops` imports this module, and that import is what
registers the ops: use them through :mod:`.ops`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = ["muon_lean_pre_", "muon_lean_update_", "muon_lean_plus_stats_",
           "muon_lean_cautious_count_"]


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
