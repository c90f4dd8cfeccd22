"""The lean Muon step on the extension's fused passes (CUDA with ``speedtronic._C``, and meta,
which counts what that path launches): one ``muon_lean_pre_`` call for every matrix of the step,
Newton-Schulz per shape group, the 16-bit guard, Muon+'s statistics
(``muon_lean_plus_stats_``) and the cautious mask's counts (``muon_lean_cautious_count_``),
then one ``muon_lean_update_`` call that applies the decay, the guard's verdict, Muon+'s scales
and the mask as it writes. GPT-2 small, fp16, counted on meta: 51 estimated launches (79 with
torch's batched passes); Muon+ +4, the rescaled cautious mask +2.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from ..kernels import ops
from .muon_chunks import _Chunk, _chunk_pieces, _guard, _orthogonalizer, _update_slabs
from .muon_plan import HYPER_KEYS, StepCache, _Part, hyper_tensor
from .sharded import sharded_orthogonalize

__all__ = ["fused_step"]

@dataclass
class _PreCall:
    """The arguments of one ``muon_lean_pre_`` call, one list entry per matrix."""

    grads: list[Tensor] = field(default_factory=list)        # (m, n) views, bank orientation
    momenta: list[Tensor] = field(default_factory=list)      # (m, n) bank slots, fp32
    outs: list[Tensor] = field(default_factory=list)         # (m, n) NS inputs, compute dtype
    grad_copies: list[Tensor] = field(default_factory=list)  # (m, n) fp32, cautious groups only
    mu_index: list[int] = field(default_factory=list)        # into the step's momentum tensors
    nesterov: list[int] = field(default_factory=list)        # 0 / 1 (the schema takes int[])
    eps: list[float] = field(default_factory=list)


@dataclass
class _UpdateCall:
    """The arguments of the step's ``muon_lean_update_`` call, one list entry per matrix."""

    params: list[Tensor] = field(default_factory=list)
    updates: list[Tensor] = field(default_factory=list)      # the direction, param orientation
    hyper_index: list[int] = field(default_factory=list)     # into the step's lr / wd tensors
    scales: list[float] = field(default_factory=list)        # the shape's lr factor
    skip_index: list[int] = field(default_factory=list)      # into ``skip``; -1: unguarded
    skip: Tensor | None = None                               # (K,) bool: the guard's verdicts
    row_scales: list[Tensor] = field(default_factory=list)   # Muon+: (rows,) fp32; (0,): none
    col_scales: list[Tensor] = field(default_factory=list)   # Muon+: (cols,) fp32; (0,): none
    grads: list[Tensor] = field(default_factory=list)        # cautious: U's layout, fp32; (0,)
    kept_index: list[int] = field(default_factory=list)      # into ``kept``; -1: no rescale
    kept: Tensor | None = None                               # (K,) int64: kept entries


def _slot_views(c: _Chunk, pt: _Part, slot: int) -> tuple[Tensor, Tensor]:
    """A slot's NS result and gradient in its parameter's orientation (the update's view)."""
    o, g = c.orth[slot - c.start], c.G[slot - c.start]               # (m, n), bank orientation
    return (o.mT, g.mT) if pt.transposed else (o, g)


def _cautious_counts(chunks: list[_Chunk], groups: list[dict[str, Any]], count: Any,
                     device: torch.device) -> tuple[dict[tuple[int, int], tuple[Tensor, int]],
                                                    Tensor | None, set[int]]:
    """The cautious mask on the fused route: one ``muon_lean_cautious_count_`` call over every
    rescaled cautious matrix of the step (zeroing + 1 launch per 128 matrices); the update masks
    and rescales as it writes. Returns ``{(id(chunk), slot): (gradient view, kept index)}``, the
    counts, and the ids of the chunks whose mask the update applies. Instead of a
    ``cautious_mask_`` call per group (3 launches: zero, count, apply) and its read + write of
    the NS result. Chunks whose NS result is not laid out like the gradient bank (the kernels
    read both through one pair of strides) keep that op."""
    plan: dict[tuple[int, int], tuple[Tensor, int]] = {}
    folded: set[int] = set()
    values, grads = [], []
    for c in chunks:
        group = groups[c.g.pgs[0]]
        if not group["cautious"] or c.orth.stride() != c.G.stride():
            continue
        folded.add(id(c))
        for pt, s, e in c.pieces:
            for slot in range(s, e):
                value, grad = _slot_views(c, pt, slot)
                index = -1
                if group["cautious_rescale"]:
                    index = len(values)
                    values.append(value)
                    grads.append(grad)
                plan[(id(c), slot)] = (grad, index)
    kept = None
    if values:
        kept = torch.empty(len(values), dtype=torch.int64, device=device)  # the op zeroes it
        count(values, grads, kept)
    return plan, kept, folded


def _plus_stats(chunks: list[_Chunk], groups: list[dict[str, Any]], stats: Any,
                device: torch.device) -> dict[tuple[int, int], tuple[Tensor, Tensor]]:
    """Muon+ on the fused route: one ``muon_lean_plus_stats_`` call over every Muon+ matrix of
    the step, reading the NS result before any cautious mask (the mask keeps signs, so it
    commutes with the positive scales). Returns ``{(id(chunk), slot): (row, col)}``, the inverse
    norms in the parameter's orientation for the update to apply: the per-group fp32 cast,
    4 launches per part and the transposing copy of the torch route become 4 launches per step
    (GPT-2 small, meta: 15 -> 4)."""
    views, logical_t = [], []
    for c in chunks:
        if not groups[c.g.pgs[0]]["muon_plus"]:
            continue
        layout_t = groups[c.g.pgs[0]].get("layout", "matrix") == "transposed"
        for pt, s, e in c.pieces:
            for slot in range(s, e):
                bank = c.orth[slot - c.start]                          # (m, n), bank orientation
                views.append((c, slot, bank.mT if pt.flip else bank))  # logical (out, in)
                logical_t.append(layout_t)
    if not views:
        return {}
    sizes = [v.shape[0] + v.shape[1] for _, _, v in views]
    flat = torch.empty(sum(sizes), dtype=torch.float32, device=device)  # no launch
    rows, cols, out = [], [], {}
    for (c, slot, v), piece, layout_t in zip(views, flat.split(sizes), logical_t, strict=True):
        r, k = piece.split((v.shape[0], v.shape[1]))                   # (out,), (in,)
        rows.append(r)
        cols.append(k)
        out[(id(c), slot)] = (k, r) if layout_t else (r, k)            # parameter orientation
    eps = [float(groups[c.g.pgs[0]]["norm_eps"]) for c, _, _ in views]
    stats([v for _, _, v in views], rows, cols, eps)
    return out


def fused_step(cache: StepCache, groups: list[dict[str, Any]]) -> None:
    """The step on the fused route: one pre-pass call (momentum, Nesterov, normalization into
    each group's Newton-Schulz bank), Newton-Schulz per group, the 16-bit guard, one update
    call (decay and update, the guard's verdict as skip flags). Every group's chunk goes
    through at once when each group is one chunk (the default budget); with smaller budgets one
    chunk at a time, so a group's banks are reused. Holding every group's NS result at once is
    the trade: on GPT-2 small 113 MB (fp16) against 2-3x fewer launches."""
    device = cache.groups[0].device
    order = sorted({i for g in cache.groups for i in g.pgs})
    pos = {index: k for k, index in enumerate(order)}
    lrs, wds, mus = ([hyper_tensor(groups[i], key, device) for i in order] for key in HYPER_KEYS)
    if cache.shard is not None:
        cache.shard.begin_step()
    pre = ops.kernel_or_fallback("muon_lean_pre_", device, [])
    update = ops.kernel_or_fallback("muon_lean_update_", device, [])
    stats = ops.kernel_or_fallback("muon_lean_plus_stats_", device, [])
    count = ops.kernel_or_fallback("muon_lean_cautious_count_", device, [])
    newton_schulz = ops.kernel_or_fallback("newton_schulz", device, [])
    work = [(g, start) for g in cache.groups for start in range(0, g.momentum.shape[0], g.chunk)]
    batches = [work] if all(g.chunks == 1 for g in cache.groups) else [[w] for w in work]
    for batch in batches:
        chunks: list[_Chunk] = []
        calls: dict[bool, _PreCall] = {}  # by whether the gradients are kept (cautious)
        for g, start in batch:
            group = groups[g.pgs[0]]
            cautious = bool(group["cautious"])
            rows, (m, n) = min(g.momentum.shape[0], g.chunk), g.shape
            if g.work is None or g.work.shape[0] < rows:
                g.work = torch.empty((rows, m, n), dtype=g.compute, device=device)
            if cautious and (g.grads is None or g.grads.shape[0] < rows):
                g.grads = torch.empty((rows, m, n), dtype=torch.float32, device=device)
            stop, pieces = _chunk_pieces(g, start)
            X = g.work[:stop - start]                                  # (c, m, n) compute
            G = g.grads[:stop - start] if cautious else None           # (c, m, n) fp32
            call = calls.setdefault(cautious, _PreCall())
            for pt, s0, e0 in pieces:
                for slot in range(s0, e0):
                    grad = pt.grads[slot - pt.start]
                    call.grads.append(grad.mT if pt.transposed else grad)
                    call.momenta.append(g.momentum[slot])
                    call.outs.append(X[slot - start])
                    if G is not None:
                        call.grad_copies.append(G[slot - start])
                    call.mu_index.append(pos[pt.pg])
                    call.nesterov.append(int(bool(group["nesterov"])))
                    call.eps.append(float(group["eps"]))
            chunks.append(_Chunk(g, start, stop, pieces, G, X))
        for c in calls.values():
            pre(c.grads, c.momenta, c.outs, c.grad_copies, mus, c.mu_index, c.nesterov, c.eps)
        done = []
        for c in chunks:
            orthogonalize = _orthogonalizer(groups[c.g.pgs[0]], c.g.compute, newton_schulz)
            if cache.shard is None:
                orth = orthogonalize(c.orth)                           # (c, m, n)
            else:
                c.g.gathered = sharded_orthogonalize(c.orth, cache.shard, orthogonalize,
                                                     c.g.gathered)
                orth = c.g.gathered[:c.stop - c.start]
            done.append(c._replace(orth=orth))
        verdict = _guard(cache, done, fill=False)
        plus = _plus_stats(done, groups, stats, device)
        masks, kept, folded = _cautious_counts(done, groups, count, device)
        none = torch.empty(0, dtype=torch.float32, device=device)  # no launch
        up = _UpdateCall(kept=kept)
        for c in done:
            flag = verdict.get(id(c))
            if flag is not None:
                up.skip = flag[0]  # one guard tensor per device: every chunk's flags in it
            for pt, slab in _update_slabs(c.g, groups[c.g.pgs[0]], c.pieces, c.start, c.G,
                                          c.orth, fused=True,
                                          mask=id(c) not in folded):
                for k in range(slab.stop - slab.start):
                    slot = slab.start + k
                    up.params.append(pt.params[slot - pt.start])
                    up.updates.append(slab.value[k])
                    up.hyper_index.append(pos[pt.pg])
                    up.scales.append(float(pt.lr_scale))
                    up.skip_index.append(-1 if flag is None else flag[1] + slot - c.start)
                    if plus:
                        row, col = plus.get((id(c), slot), (none, none))
                        up.row_scales.append(row)
                        up.col_scales.append(col)
                    if masks:
                        grad, index = masks.get((id(c), slot), (none, -1))
                        up.grads.append(grad)
                        up.kept_index.append(index)
        update(up.params, up.updates, lrs, wds, up.hyper_index, up.scales, up.skip,
               up.skip_index, up.row_scales, up.col_scales, up.grads, up.kept, up.kept_index)
