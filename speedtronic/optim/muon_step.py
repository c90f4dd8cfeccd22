"""The lean Muon step: a few dozen whole-step ops, no host syncs, CUDA-graph safe.

Why this shape (counted with a dispatch-mode counter, ``benchmarks/bench_step_dispatch.py``):
the per-bucket step it replaces dispatched ~1,080 kernel-bearing ops on the GPT-2-small set (36
buckets, one host sync per fp16 bucket); ``torch.optim.Muon`` dispatches ~1,660. On an H200 host
one dispatched op costs ~15 us, so op count *is* step time for a host-bound step.

Matrices are grouped by their **wide** shape ``(m, n)``, ``m <= n``: a tall ``(n, m)`` matrix
joins the ``(m, n)`` group transposed (the polar factor of ``X^T`` is the transpose of the polar
factor of ``X``), so GPT-2 small is two groups, ``48 x 768^2`` and ``24 x 768 x 3072``. Each
group owns persistent banks, allocated once and reused every step:

* ``momentum``: ``(b, m, n)`` fp32, the momentum buffers; ``state[p]["momentum_buffer"]`` is a
  view into it (transposed for a tall matrix), so ``state_dict()`` is unchanged;
* ``grads``: ``(chunk, m, n)`` fp32, the step's gradients gathered in the bank's orientation;
* ``work``: ``(chunk, m, n)`` in the Newton-Schulz dtype when that is not fp32;
* on CPU, the Newton-Schulz products (``kernels.newton_schulz.Workspace``): glibc hands every
  fresh tensor above 32 MiB out as new, page-faulted memory, which cost 14-23% of GPT-2 small's
  fp32 step on one thread.

Per param group: ``1 - lr wd`` (1 ``addcmul``) and the decoupled decay (1 ``_foreach_mul_``).
Per group and chunk: gather (1 op, +2 for the transposed part), momentum ``lerp`` (1), Nesterov
``lerp_`` (1), Frobenius norm + clamp + divide (3), one batched Newton-Schulz, [Muon+: 1-2 op
calls], [cautious: 5-7], then per part scale (1) and ``_foreach_add_`` (1). The 16-bit guard
runs once per step over every group's result: a sum and a ``masked_fill_`` per group, plus 3.
Hyper-parameters ``lr``, ``weight_decay`` and ``momentum`` are 0-d device tensors (floats are
converted once), so an LR schedule never recompiles a compiled step and a captured CUDA graph
reads the current value.

The chunk size comes from a byte budget for the step's workspaces (:func:`default_budget_bytes`):
one chunk per group unless the budget says otherwise.

Where each piece lives: ``muon_plan`` (the grouping, the banks, the budget, hyper-parameter
tensors), ``muon_chunks`` (the batched torch route, chunk by chunk), ``muon_fused`` (the
extension's fused passes, which also apply Muon+ and the cautious mask in the update); this
module chooses the route (:func:`_fused_passes`) and runs the torch route's step. The plan's
public names are re-exported here.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from .muon_chunks import _Chunk, _finish, _orthogonalized_chunk, _per_slot
from .muon_fused import fused_step
from .muon_plan import (
    HYPER_KEYS,
    NS_DTYPES,
    StepCache,
    StepEntry,
    _build,
    _signature,
    adjusted_lr_scale,
    default_budget_bytes,
    hyper_tensor,
    planted,
    tensorize_hyper,
    workspace_bytes_per_matrix,
)

__all__ = ["FUSED_ROUTE_OFF_CUDA", "HYPER_KEYS", "NS_DTYPES", "StepCache", "StepEntry",
           "adjusted_lr_scale", "default_budget_bytes", "hyper_tensor", "lean_muon_step",
           "planted", "tensorize_hyper", "workspace_bytes_per_matrix"]


def lean_muon_step(cache: StepCache, groups: list[dict[str, Any]],
                   entries: list[StepEntry], state: Mapping[Tensor, dict] | None = None) -> None:
    """One Muon step over ``entries``, one per matrix in a stable order; ``state`` is the
    optimizer's state (None: the state dicts the entries carry)."""
    if not entries:
        return
    if torch.compiler.is_compiling():
        # Traced: dynamo guards on the tensors and the groups; rebuilding inside a graph would
        # allocate banks there, so a plan must exist (the first eager step, or `warmup`).
        # load_state_dict and reset_state drop the plan eagerly (MuonCacheMixin).
        fresh = cache.signature is None
    else:
        if state is None:
            state = {e.param: e.st for e in entries}
        fresh = cache.signature != _signature(entries, groups) or not planted(cache, state)
    if fresh:
        # Matrices that leave the plan (grad None: frozen, or an MoE expert with no tokens) keep
        # a momentum view into the old bank; give them their own copy so the bank can be freed.
        present = {id(e.param) for e in entries}
        for p, view in cache.views:
            st = state.get(p) if state is not None and id(p) not in present else None
            if st is not None and st.get("momentum_buffer") is view:
                st["momentum_buffer"] = view.clone()
        _build(cache, entries, groups)
    for g in cache.groups:  # this step's gradients (and work copies, for written-back layouts)
        for part in g.parts:
            part.params = [entries[i].work for i in part.entries]
            part.grads = [entries[i].grad for i in part.entries]
    if _fused_passes(cache):
        fused_step(cache, groups)
        return
    hyper: dict[int, dict[str, Tensor]] = {}
    for g in cache.groups:
        for index in g.pgs:
            if index not in hyper:
                pg = groups[index]
                lr, wd, mu = (hyper_tensor(pg, k, g.device) for k in HYPER_KEYS)
                # 1 - lr wd in one op (was mul + rsub); the momentum lerp takes mu itself
                decay = torch.addcmul(cache.ones[str(g.device)], lr, wd, value=-1.0)
                hyper[index] = {"lr": lr, "decay": decay, "mu": mu}
    # Decoupled weight decay first, one multi-tensor op per param group over all its matrices:
    # p (1 - lr wd) - lr s O  ==  (p (1 - lr wd)) - lr s O, and O does not depend on p.
    for index in hyper:
        works = [entries[i].work for g in cache.groups for part in g.parts if part.pg == index
                 for i in part.entries]
        torch._foreach_mul_(works, hyper[index]["decay"])
    # 16-bit NS with one chunk per group (the default budget on any GPU that fits the model):
    # every group's Newton-Schulz first, then one guard over all of them (2K + 3 ops for K
    # groups instead of 5K), then the updates; it holds every group's NS result at once (on
    # GPT-2 small, fp16: 57 + 113 MB). Unguarded (fp32) steps and chunked groups finish each
    # chunk right away: nothing to batch, and the next chunk reuses the gradient bank.
    if cache.shard is not None:
        cache.shard.begin_step()  # the shares rotate over this step's groups (optim/sharded.py)
    together = bool(cache.guards) and all(g.chunks == 1 for g in cache.groups)
    pending: list[_Chunk] = []
    for g in cache.groups:
        mu_all = _per_slot(g, hyper, "mu")  # once per group: 2 ops when param groups mix
        for start in range(0, g.momentum.shape[0], g.chunk):
            chunk = _orthogonalized_chunk(g, groups[g.pgs[0]], mu_all, cache.shard, start)
            if together:
                pending.append(chunk)
            else:
                _finish(cache, [chunk], groups, hyper)
                del chunk  # its NS result must not outlive the update (+113 MB on GPT-2 small)
    if pending:
        _finish(cache, pending, groups, hyper)


FUSED_ROUTE_OFF_CUDA = {"meta": True, "cpu": False}
"""Which non-CUDA devices take the fused route: meta (a counted step) does, to count what CUDA
launches with the extension; tests turn cpu on (the ops' PyTorch bodies) to check the route's
numerics against the batched torch route, and the dispatch bench turns meta off to count the
CUDA route without the extension. A CPU run has no reason to take it."""


def _fused_passes(cache: StepCache) -> bool:
    """The pre-pass and the update as two fused ops over every matrix of the step (CUDA with
    the extension built, and meta, which counts what that CUDA path launches), instead of the
    batched torch ops: 79 -> 51 estimated launches on GPT-2 small (fp16 NS). Without the
    extension, with float64 anywhere, or across devices, the torch route runs."""
    devices = {g.device for g in cache.groups}
    if len(devices) != 1:
        return False
    kind = next(iter(devices)).type
    if kind in FUSED_ROUTE_OFF_CUDA:
        return FUSED_ROUTE_OFF_CUDA[kind]
    from ..kernels import extension

    return kind == "cuda" and extension.available() and cache.kernel_dtypes
