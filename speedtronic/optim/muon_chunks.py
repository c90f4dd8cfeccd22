"""The lean Muon step's batched torch route, one Newton-Schulz chunk of a shape group at a
time: gather the gradients into the bank, momentum and Nesterov, normalize, orthogonalize
(:func:`_orthogonalized_chunk`), the 16-bit guard (:func:`_guard`), Muon+ and the cautious
mask (:func:`_update_slabs`), and the multi-tensor update (:func:`_finish`). The fused route
(``muon_fused``) reuses the chunk bookkeeping, the orthogonalizer, the guard and the update
slabs.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import Tensor

from ..kernels import ops
from ..kernels.newton_schulz import Workspace, workspace_scope
from .muon_plan import StepCache, _Group, _Part
from .sharded import sharded_orthogonalize


def _chunk_pieces(g: _Group, start: int) -> tuple[int, list[tuple[_Part, int, int]]]:
    """The stop slot of the group's chunk from ``start``, and the (part, first, stop) slots of
    each part it covers."""
    stop = min(g.momentum.shape[0], start + g.chunk)
    return stop, [(pt, max(pt.start, start), min(pt.stop, stop)) for pt in g.parts
                  if pt.start < stop and pt.stop > start]


def _orthogonalizer(group: dict[str, Any], compute: torch.dtype,
                    newton_schulz: Any) -> Any:
    """``X (c, m, n) normalized -> its polar factor`` with the group's Newton-Schulz settings."""
    flat = ops.resolve_coefficients(group["ns_coefficients"], group["ns_steps"])
    steps, eps = int(group["ns_steps"]), float(group["eps"])

    def orthogonalize(X: Tensor) -> Tensor:
        return newton_schulz(X, steps, flat, eps, compute, "auto", True)

    return orthogonalize


def _per_slot(g: _Group, hyper: dict[int, dict[str, Tensor]], key: str) -> Tensor:
    """A momentum setting for every slot: the group's 0-d tensor, or a (b, 1, 1) gather when
    param groups with different values share this shape group (2 ops)."""
    if g.slot_pg is None:
        return hyper[g.pgs[0]][key]
    return torch.stack([hyper[i][key] for i in g.pgs])[g.slot_pg].view(-1, 1, 1)


class _Chunk(NamedTuple):
    """One Newton-Schulz batch of a group, orthogonalized, waiting for its update."""

    g: _Group
    start: int
    stop: int
    pieces: list             # (part, first slot, stop slot) of the parts it covers
    G: Tensor | None         # (c, m, n) fp32: its gradients (the cautious mask reads them)
    orth: Tensor             # (c, m, n) compute dtype


def _orthogonalized_chunk(g: _Group, group: dict[str, Any], mu_all: Tensor, shard: Any,
                          start: int) -> _Chunk:
    """The group's chunk from slot ``start``, orthogonalized (a function, not a generator:
    Dynamo broke the compiled step's graph at a generator resumed between updates)."""
    m, n = g.shape
    b = g.momentum.shape[0]
    if g.grads is None or g.grads.shape[0] < min(b, g.chunk):
        g.grads = torch.empty((min(b, g.chunk), m, n), dtype=torch.float32, device=g.device)
        if g.compute != torch.float32:
            g.work = torch.empty((min(b, g.chunk), m, n), dtype=g.compute, device=g.device)
    flat = ops.resolve_coefficients(group["ns_coefficients"], group["ns_steps"])
    steps, eps = int(group["ns_steps"]), float(group["eps"])
    cautious = bool(group["cautious"])  # the mask needs G after NS: no writing over it
    newton_schulz = ops.kernel_or_fallback("newton_schulz", g.device, [])
    if g.device.type == "cpu" and not torch.compiler.is_compiling():
        # Eager CPU: the products go into the group's persistent buffers (a fresh >32 MiB
        # tensor is page-faulted in every time: 14-23% of GPT-2 small's fp32 step; see
        # newton_schulz.Workspace). The result lives there until this group's next NS, after
        # this chunk's update (chunks of one group finish in turn; groups own their buffers).
        if g.ns_workspace is None:
            g.ns_workspace = Workspace()
        ws = g.ns_workspace

        def orthogonalize(X: Tensor) -> Tensor:  # (c, m, n) normalized, compute dtype
            with workspace_scope(ws):
                return newton_schulz(X, steps, flat, eps, g.compute, "auto", True)
    else:
        def orthogonalize(X: Tensor) -> Tensor:  # (c, m, n) normalized, compute dtype
            return newton_schulz(X, steps, flat, eps, g.compute, "auto", True)
    stop, pieces = _chunk_pieces(g, start)
    G = g.grads[:stop - start]                                     # (c, m, n) fp32
    for pt, s, e in pieces:  # gather this chunk's gradients in the bank orientation
        grads = pt.grads[s - pt.start:e - pt.start]
        if pt.transposed and g.device.type == "cpu":
            # CPU: one stack of the transposed views, 2x faster than stack + transposed copy
            # (12 x 3072x768 fp32: 67 vs 132 ms, one thread) and one op fewer. On CUDA a
            # non-contiguous stack is one copy per input: there stack + copy is 2 launches.
            torch.stack([x.mT for x in grads], out=G[s - start:e - start])
        elif pt.transposed:
            G[s - start:e - start].copy_(torch.stack(grads).mT)   # (k, n, m) -> (k, m, n)
        else:
            torch.stack(grads, out=G[s - start:e - start])
    M = g.momentum[start:stop]                                     # (c, m, n) fp32
    mu = mu_all[start:stop] if mu_all.dim() else mu_all
    torch.lerp(G, M, mu, out=M)                                    # M <- mu M + (1-mu) G
    if group["nesterov"]:                                          # U = G + mu (M - G)
        U = torch.lerp(G, M, mu) if cautious else G.lerp_(M, mu)
    else:
        U = M
    norm = torch.linalg.vector_norm(U, dim=(-2, -1), keepdim=True)  # (c, 1, 1)
    norm = norm.clamp_(min=eps)
    keep = U is M or (U is G and cautious)                         # U must survive the divide
    if g.work is not None and g.device.type == "cpu" and not keep:
        # CPU: an fp32 -> 16-bit divide into the work bank runs 5.5x slower than dividing in
        # place and converting (24 x 768x3072: 119 vs 22 ms, one thread); one op more.
        X = g.work[:stop - start].copy_(U.div_(norm))              # (c, m, n) compute
    elif g.work is not None:
        X = torch.div(U, norm, out=g.work[:stop - start])          # (c, m, n) compute
    elif keep:
        X = U / norm                                               # M must survive
    else:
        X = U.div_(norm)
    if shard is None:
        orth = orthogonalize(X)                                    # (c, m, n)
    else:  # this rank's share, then all of them (optim/sharded.py)
        g.gathered = sharded_orthogonalize(X, shard, orthogonalize, g.gathered)
        orth = g.gathered[:stop - start]                           # (c, m, n)
    return _Chunk(g, start, stop, pieces, G, orth)


def _guard(cache: StepCache, chunks: list[_Chunk], fill: bool = True) -> dict[int, tuple]:
    """16-bit NS results, checked per matrix with no host sync: a matrix whose result is not
    finite gets no update this step (its weight decay stays) and its hit count grows; the other
    matrices of its chunk update as usual (the whole chunk, every matrix of a shape group, once
    stopped for good after one inf gradient).

    A normalized input cannot overflow the iteration (its entries stay below ~1.2), so a
    non-finite result means a non-finite gradient reached the momentum, where it stays: the
    matrix is skipped again each step until :meth:`StepCache.restart_nonfinite_momentum`
    (called where the counters are read, the trainer's log step) restarts it. Restarting it
    here would cost a pass over every guarded momentum bank each step (0.68 GB on GPT-2 small,
    ~0.19 ms at 3.5 TB/s, ~5% of the predicted H200 step) for an event that needs a bad
    gradient. With ``fill`` the bad matrices' results are zeroed here; without,
    ``{id(chunk): (bad flags, index of its first matrix)}`` is returned for the fused update."""
    verdict: dict[int, tuple] = {}
    by_device: dict[str, list[_Chunk]] = {}
    for c in chunks:
        if c.g.guard_slot is not None:
            by_device.setdefault(str(c.g.device), []).append(c)
    for device, guarded in by_device.items():
        guard = cache.guards[device]
        firsts = [c.g.guard_slot + c.start for c in guarded]  # one slot per matrix
        for c, first in zip(guarded, firsts, strict=True):
            sums = guard.sums[first:first + c.stop - c.start]               # (c,) fp32
            if c.orth.dtype == torch.bfloat16:
                # bf16 has fp32's range, so its own sum cannot overflow; on CPU a bf16 sum into
                # fp32 was 30x slower than a bf16 sum (48 x 768^2: 79 vs 2.4 ms)
                sums.copy_(c.orth.sum(dim=(-2, -1)))
            else:  # fp16: summed in fp32 (an fp16 sum of finite entries could overflow)
                torch.sum(c.orth, dim=(-2, -1), dtype=torch.float32, out=sums)
        lo = min(firsts)
        hi = max(f + c.stop - c.start for c, f in zip(guarded, firsts, strict=True))
        # A 16-bit result is finite iff its fp32 sum is (|entries| < 4: no overflow), and
        # x * 0 is NaN exactly for a non-finite x: 2 small ops instead of isfinite's 4.
        bad = guard.sums[lo:hi].mul(0).isnan()                        # (hi - lo,) bool
        guard.hits[lo:hi].add_(bad)
        for c, first in zip(guarded, firsts, strict=True):
            if fill:
                c.orth.masked_fill_(bad[first - lo:first - lo + c.stop - c.start]
                                    .view(-1, 1, 1), 0)
            else:
                verdict[id(c)] = (bad, first - lo)
    return verdict


def _finish(cache: StepCache, chunks: list[_Chunk], groups: list[dict[str, Any]],
            hyper: dict[int, dict[str, Tensor]]) -> None:
    """Guard, Muon+ / cautious, and the parameter updates of orthogonalized chunks."""
    _guard(cache, chunks)
    for g, start, _, pieces, G, orth in chunks:
        group = groups[g.pgs[0]]
        for pt, slab in _update_slabs(g, group, pieces, start, G, orth):
            params = pt.params[slab.start - pt.start:slab.stop - pt.start]
            upd = _update_buffer(g, G, start, slab, params[0].dtype)
            torch.mul(slab.value, hyper[pt.pg]["lr"], out=upd)         # contiguous, param dtype
            torch._foreach_add_(params, list(upd.unbind(0)), alpha=-pt.lr_scale)


def _update_buffer(g: _Group, G: Tensor, start: int, slab: _Slab, dtype: torch.dtype) -> Tensor:
    """Where a slab's ``lr * O`` goes before it is added to the parameters: contiguous, in the
    parameter dtype, shaped like ``slab.value`` ((k, m, n), or (k, n, m) for a tall part).

    Eager CPU, fp32 parameters: the slab's own rows of the gradient bank ``G``, which nothing
    reads any more (the momentum took it, the cautious mask has run, and a group's next chunk
    gathers into it only after this one's update). A fresh tensor there is page-faulted in
    every step (glibc maps every >32 MiB tensor anew): GPT-2 small's 48 x 768^2 update took
    1230 ms of a 9.3 s bf16 step in a first-touch multiply, against 42 ms into touched
    memory. Elsewhere (CUDA's caching allocator has no such cost; a traced step) a new tensor."""
    shape = slab.value.shape
    if g.device.type != "cpu" or dtype != G.dtype or torch.compiler.is_compiling():
        return torch.empty(shape, dtype=dtype, device=g.device)
    rows = G[slab.start - start:slab.stop - start]                     # (k, m, n) fp32
    if rows.untyped_storage().data_ptr() == slab.value.untyped_storage().data_ptr():
        return torch.empty(shape, dtype=dtype, device=g.device)        # O is G itself (0 NS steps)
    return rows.view(shape)                                            # contiguous: any order


class _Slab(NamedTuple):
    start: int               # first slot
    stop: int
    value: Tensor            # (k, *work shape): what the update subtracts, before lr


def _update_slabs(g: _Group, group: dict[str, Any], pieces: list, start: int, G: Tensor,
                  orth: Tensor, fused: bool = False,
                  mask: bool = True) -> list[tuple[_Part, _Slab]]:
    """Each piece's update direction in its parameters' orientation, after Muon+ (rows then
    columns of each part's logical matrix; not on the ``fused`` route, whose update applies
    it) and the cautious mask (not with ``mask=False``: the fused update applies it)."""
    eps = float(group["norm_eps"])
    muon_plus = not fused and bool(group["muon_plus"])
    cpu = orth.device.type == "cpu"
    if muon_plus:
        normalize = (_muon_plus_cpu_ if cpu else
                     ops.kernel_or_fallback("muon_plus_normalize", orth.device, [torch.float32]))
    if muon_plus and any(pt.flip for pt, _, _ in pieces):
        # Mixed orientations: normalize each piece in its logical orientation, (k, m, n) or
        # (k, n, m), and hand that straight to the update (no copy back, no cat: 2 launches
        # fewer).
        out = []
        orth = orth.float()                                            # (c, m, n) fp32
        for pt, s, e in pieces:
            bank = orth[s - start:e - start]                           # (k, m, n)
            if cpu:  # in place, through the transposed view: no copy
                logical = normalize(bank.mT if pt.flip else bank, eps)
            else:
                # contiguous in, contiguous out (the kernel copies a strided input anyway, and
                # the op's fake kernel promises a contiguous result)
                logical = normalize(bank.mT.contiguous() if pt.flip else bank, eps)
            if group["cautious"]:
                grad = G[s - start:e - start]                          # (k, m, n)
                logical = _cautious(logical, grad.mT if pt.flip else grad, group, g.shape)
            bank = logical.mT if pt.flip else logical                  # (k, m, n) view
            out.append((pt, _Slab(s, e, bank.mT if pt.transposed else bank)))
        return out
    if muon_plus:
        orth = normalize(orth.float(), eps)                            # (c, m, n) fp32
    if group["cautious"] and mask:
        # The fused route masks the NS result in its own dtype (the kernel computes in fp32 and
        # the fused update reads fp16 directly): no fp32 copy of it, 2 launches and a 340 MB
        # write + read fewer on GPT-2 small; the rescaled value is rounded once more to fp16
        # (2^-11 relative, below the NS result's own rounding).
        orth = _cautious(orth if not muon_plus and fused else orth.float(), G, group, g.shape)
    out = []
    for pt, s, e in pieces:
        slab = orth[s - start:e - start]                               # (k, m, n)
        out.append((pt, _Slab(s, e, slab.mT if pt.transposed else slab)))
    return out


def _muon_plus_cpu_(X: Tensor, eps: float) -> Tensor:
    """Muon+ in place on ``X (k, r, c)`` fp32, any strides: each row divided by
    ``sqrt(sum of squares + eps)``, then each column of the result likewise (the math of the
    ``muon_plus_normalize`` op). CPU: two norm reductions and two in-place scalings, where the
    op's body makes three fresh tensors of ``X``'s size (each one above 32 MiB is page-faulted
    in anew every step) and a transposed part needed a contiguous copy first."""
    X.mul_(torch.linalg.vector_norm(X, dim=-1, keepdim=True).square_().add_(eps).rsqrt_())
    X.mul_(torch.linalg.vector_norm(X, dim=-2, keepdim=True).square_().add_(eps).rsqrt_())
    return X


def _cautious(orth: Tensor, G: Tensor, group: dict[str, Any], shape: tuple[int, int]) -> Tensor:
    """Zero the entries of ``orth (k, m, n) fp32`` whose sign disagrees with ``G``, rescaled
    by ``numel / (kept + 1)`` per matrix with ``cautious_rescale``. On CPU in place, over
    ``G`` as well: the gradient bank is not read again before the update overwrites it."""
    rescale = bool(group["cautious_rescale"])
    if orth.device.type in ("cuda", "meta"):
        # One fused op (1-3 launches) for the whole chunk instead of 5-7 elementwise passes;
        # in place: orth is this step's own buffer (NS output or a Muon+ result)
        mask_ = ops.kernel_or_fallback("cautious_mask_", orth.device, [orth.dtype, G.dtype])
        mask_(list(orth.unbind(0)), list(G.contiguous().unbind(0)), rescale)  # 1 copy at most
        return orth
    # CPU: batched over the chunk (the op's PyTorch body goes one matrix at a time), in place:
    # the products and the mask overwrite the gradient bank (momentum has taken it, and the
    # update writes lr * O there next), so no fresh tensor of the chunk's size is made (four
    # before: product, mask, masked, rescaled; glibc page-faults each one above 32 MiB anew).
    keep = G.mul_(orth).gt_(0)                                         # (k, m, n) 1.0 / 0.0
    if rescale:
        kept = keep.sum(dim=(-2, -1), keepdim=True)  # (k, 1, 1) fp32: exact below 2^24 entries
        keep.mul_((shape[0] * shape[1]) / kept.add_(1))
    return orth.mul_(keep)
