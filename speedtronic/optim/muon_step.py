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
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from torch import Tensor

from ..kernels import ops
from ..kernels.newton_schulz import Workspace, workspace_scope
from .sharded import sharded_orthogonalize

__all__ = ["HYPER_KEYS", "NS_DTYPES", "StepCache", "StepEntry", "adjusted_lr_scale",
           "default_budget_bytes", "hyper_tensor", "lean_muon_step", "tensorize_hyper",
           "workspace_bytes_per_matrix"]

#: Group values the kernels read as 0-d fp32 device tensors.
HYPER_KEYS = ("lr", "weight_decay", "momentum")

BUDGET_FRACTION = 0.08
"""Default workspace budget: 8% of the device's memory (11 GB on an H200, 1.9 GB on a 24 GB
host), between :data:`BUDGET_FLOOR` and :data:`BUDGET_CEILING`. Per group, by
:func:`workspace_bytes_per_matrix` with fp16 NS: GPT-2 small needs 0.47 GiB (48 x 768^2) and
0.63 GiB (24 x 768x3072) to run each group as one batch; the 1B-class set 2.25, 0.38 and 9.0 GiB
(48 x 2048x8192). So an H200 runs both sets one batch per group, and a 24 GB GPU GPT-2 small;
the 1B set's largest group there runs in 5 chunks (+4 x that group's ~40 ops)."""
BUDGET_FLOOR = 256 << 20
"""256 MiB: below this even a 4096^2 group (the 1B set's largest square group) splits into
chunks of a few matrices and the launch count grows with the model."""
BUDGET_CEILING = 16 << 30
"""16 GiB: the 1B-class set's largest group (9.0 GiB) as one batch, with room to ~1.8x that."""

NS_DTYPES = {"auto": None, "bf16": torch.bfloat16, "fp16": torch.float16,
              "fp32": torch.float32, "fp64": torch.float64}


def _device_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 16 << 30


_BUDGETS: dict[str, int] = {}  # per device, filled eagerly when a group is added


def default_budget_bytes(device: torch.device) -> int:
    """The workspace budget used when the optimizer's ``workspace_budget`` is ``None``."""
    name = str(device)
    if name not in _BUDGETS:  # the first call is eager (tensorize_hyper), never traced
        total = _device_memory_bytes(torch.device(device))
        _BUDGETS[name] = int(min(BUDGET_CEILING, max(BUDGET_FLOOR, BUDGET_FRACTION * total)))
    return _BUDGETS[name]


def workspace_bytes_per_matrix(m: int, n: int, compute: torch.dtype) -> int:
    """Workspace bytes one ``(m, n)`` matrix (``m <= n``) costs inside a batch: the fp32 gather
    bank, the NS input in the compute dtype (when not fp32), and the iteration's temporaries
    (two ``(m, n)`` iterates and four ``(m, m)`` products: the Gram iteration's ``R``, ``P``,
    ``Q`` and ``R P`` are alive together). On CPU these temporaries are kept between steps
    (``newton_schulz.Workspace``), on CUDA they return to the caching allocator."""
    cb = torch.empty((), dtype=compute).element_size()
    work = 0 if compute == torch.float32 else m * n * cb
    return 4 * m * n + work + 2 * m * n * cb + 4 * m * m * cb


@dataclass
class _Part:
    """Consecutive slots of one group that share an orientation relative to the bank."""

    start: int
    stop: int
    pg: int                    # its param group (lr, weight decay)
    transposed: bool           # stored (n, m): the bank holds the transpose
    flip: bool                 # the logical (out, in) matrix is the transpose of the bank's
    lr_scale: float
    entries: list[int] = field(default_factory=list)   # positions in the step's entry list
    params: list[Tensor] = field(default_factory=list)
    grads: list[Tensor] = field(default_factory=list)


@dataclass
class _Group:
    key: tuple
    shape: tuple[int, int]     # the bank's (m, n), m <= n except for a tall split block
    pgs: list[int]             # param groups with slots here (one, unless lrs differ by group)
    device: torch.device
    compute: torch.dtype
    parts: list[_Part]
    chunk: int                 # matrices per Newton-Schulz batch (the budget's answer)
    momentum: Tensor           # (b, m, n) fp32
    grads: Tensor | None = None  # (chunk, m, n) fp32, allocated on first use
    work: Tensor | None = None   # (chunk, m, n) compute dtype, when not fp32
    guard_slot: int | None = None    # 16-bit NS: its first chunk's slot in the device's guard
    gathered: Tensor | None = None   # sharded NS: the all-gather buffer (W * per, m, n)
    slot_pg: Tensor | None = None    # (b,) int64: index into pgs per slot, when len(pgs) > 1
    ns_workspace: Workspace | None = None  # eager CPU steps only (kernels.newton_schulz)

    @property
    def chunks(self) -> int:
        """Newton-Schulz batches per step."""
        return math.ceil(self.momentum.shape[0] / self.chunk)


@dataclass
class _Guard:
    """The 16-bit Newton-Schulz guard of one device: one slot per guarded chunk."""

    sums: Tensor               # (K,) fp32: this step's sum of each chunk's NS result
    hits: Tensor               # (K,) int64: steps whose chunk result was not finite


@dataclass
class StepCache:
    """What a Muon optimizer keeps between steps: the groups and their banks, keyed by the
    step's matrix set. Any change (a new parameter, a group setting, ``load_state_dict``, a
    momentum buffer replaced) rebuilds it, copying the current momentum into new banks."""

    budget_bytes: int | None = None
    shard: Any = None  # sharded.ShardSpec: Newton-Schulz split across data-parallel ranks
    signature: tuple | None = None
    groups: list[_Group] = field(default_factory=list)
    views: list[tuple[dict, Tensor]] = field(default_factory=list)  # (state, planted view)
    guards: dict[str, _Guard] = field(default_factory=dict)  # per device, 16-bit NS only
    ones: dict[str, Tensor] = field(default_factory=dict)    # per device: a 0-d fp32 one
    kernel_dtypes: bool = False  # every parameter, gradient and NS dtype has a CUDA kernel

    def guard_counters(self) -> list[tuple[tuple[int, int], Tensor]]:
        """``(shape, 0-d int64 device tensor)``: the 16-bit guard's hit count of each guarded
        group, for a caller that reads it together with other device values (no sync here)."""
        return [(g.shape, self.guards[str(g.device)].hits[g.guard_slot:g.guard_slot
                                                          + g.chunks].sum())
                for g in self.groups if g.guard_slot is not None]

    def nonfinite_counts(self) -> list[tuple[tuple[int, int], int]]:
        """``(shape, non-finite 16-bit results: steps x chunks hit)`` per group with a hit
        (reads the device counters in one host sync, so call it where the trainer already
        reads values)."""
        counters = self.guard_counters()
        if not counters:
            return []
        device = counters[0][1].device  # one read (a .to() on the same device is free)
        values = torch.stack([t.to(device) for _, t in counters]).tolist()
        return [(shape, v) for (shape, _), v in zip(counters, values, strict=True) if v]


def hyper_tensor(group: dict[str, Any], key: str, device: torch.device) -> Tensor:
    """``group[key]`` as a 0-d fp32 tensor on ``device``, stored back into the group, so a
    float is converted once and an LR scheduler then fills the tensor in place."""
    value = group[key]
    if isinstance(value, Tensor):
        if value.device == device and value.dtype == torch.float32 and value.dim() == 0:
            return value
        value = value.detach().to(device=device, dtype=torch.float32).reshape(())
    else:
        value = torch.tensor(float(value), dtype=torch.float32, device=device)
    group[key] = value
    return value


def tensorize_hyper(group: dict[str, Any]) -> None:
    """Turn a Muon group's ``lr``, ``weight_decay`` and ``momentum`` into 0-d fp32 tensors on
    its parameters' device (once, when the group is added)."""
    params = group.get("params") or []
    device = params[0].device if params else torch.device("cpu")
    for key in HYPER_KEYS:
        if group.get(key) is not None:
            hyper_tensor(group, key, device)
    default_budget_bytes(device)


def adjusted_lr_scale(adjust_lr_fn: str | None, shape: Sequence[int]) -> float:
    """torch.optim.Muon's shape factor: ``original``/None = sqrt(max(1, A/B)) (Keller),
    ``match_rms_adamw`` = 0.2 sqrt(max(A, B)) (Moonlight)."""
    a, b = shape[0], shape[1]
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        return math.sqrt(max(1.0, a / b))
    if adjust_lr_fn == "match_rms_adamw":
        return 0.2 * math.sqrt(max(a, b))
    # torch.optim.Muon's wording, so code matching torch's errors matches ours.
    raise ValueError(f"Adjust learning rate function {adjust_lr_fn} is not supported "
                     "(adjust_lr_fn must be None, 'original' or 'match_rms_adamw')")


class StepEntry(NamedTuple):
    """One matrix of a step (built by ``muon._step_entries``)."""

    pg: int                  # index of its param group
    param: Tensor            # the parameter it belongs to
    block: int               # which of the parameter's ``blocks`` matrices (split layouts)
    blocks: int
    work: Tensor             # what the step updates in place (the matrix, a view or a copy)
    grad: Tensor             # its gradient, in work's shape
    state: dict              # the parameter's optimizer state
    momentum: Tensor | None  # its view of state["momentum_buffer"], None before the first step


def _settings(group: dict[str, Any]) -> tuple:
    coeffs = group["ns_coefficients"]
    return (group["ns_steps"], coeffs if isinstance(coeffs, str) else tuple(coeffs),
            group["eps"], group["ns_dtype"], bool(group["nesterov"]), bool(group["muon_plus"]),
            group["norm_eps"], bool(group["cautious"]), bool(group["cautious_rescale"]),
            group.get("layout", "matrix"), group["adjust_lr_fn"])


def _signature(entries: list[StepEntry], groups: list[dict[str, Any]]) -> tuple:
    return (tuple((e.pg, id(e.param), e.block, e.blocks) for e in entries),
            tuple(_settings(g) for g in groups))


def _build(cache: StepCache, entries: list[StepEntry], groups: list[dict[str, Any]]) -> None:
    """Group the step's matrices and plant their momentum buffers into fresh banks."""
    buckets: dict[tuple, list[tuple]] = {}
    for index, e in enumerate(entries):
        m, n = e.work.shape
        # A split block's momentum is a row block of its parameter's buffer: it stays in the
        # stored orientation so the K blocks are K consecutive bank slots (one buffer view).
        transposed = m > n and e.blocks == 1
        shape = (n, m) if transposed else (m, n)
        key = (shape, e.work.device, _settings(groups[e.pg]))
        buckets.setdefault(key, []).append((transposed, index, e))
    cache.groups, cache.views = [], []
    for key, items in buckets.items():
        shape, device = key[0], key[1]
        # stored orientation first, then transposed; within each, param group by param group
        items.sort(key=lambda item: (item[0], item[2].pg, item[1]))
        pgs = sorted({e.pg for _, _, e in items})
        group = groups[pgs[0]]  # every setting but lr / weight decay / momentum is shared
        compute = ops.resolve_compute_dtype(device, torch.float32, NS_DTYPES[group["ns_dtype"]])
        b = len(items)
        bank = torch.empty((b, *shape), dtype=torch.float32, device=device)  # (b, m, n)
        parts: list[_Part] = []
        layout_t = group.get("layout", "matrix") == "transposed"
        for i, (transposed, index, e) in enumerate(items):
            pg, p, block, blocks, work, _, st, buf = e
            slot = bank[i].mT if transposed else bank[i]                 # work's shape
            if buf is None:
                slot.zero_()
            else:
                slot.copy_(buf)
            if not parts or parts[-1].transposed != transposed or parts[-1].pg != pg:
                logical = tuple(work.shape)[::-1] if layout_t else tuple(work.shape)
                parts.append(_Part(i, i, pg, transposed, transposed != layout_t,
                                   adjusted_lr_scale(group["adjust_lr_fn"], logical)))
            part = parts[-1]
            part.stop = i + 1
            part.entries.append(index)
            if block == blocks - 1:  # the parameter's last block: plant its buffer view
                first = i - blocks + 1
                view = (bank[first].mT if transposed else
                        bank[first:i + 1].reshape(-1, *shape[1:]) if blocks > 1 else bank[i])
                view = view.view(_buffer_shape(p, group.get("layout", "matrix")))
                st["momentum_buffer"] = view
                cache.views.append((st, view))
        budget = cache.budget_bytes or default_budget_bytes(device)
        per = workspace_bytes_per_matrix(min(shape), max(shape), compute)
        chunk = max(1, min(b, budget // max(1, per)))
        grp = _Group(key, shape, pgs, device, compute, parts, chunk, bank)
        if len(pgs) > 1:
            grp.slot_pg = torch.tensor([pgs.index(e.pg) for _, _, e in items], device=device)
        cache.groups.append(grp)
    cache.ones = {str(grp.device): torch.ones((), dtype=torch.float32, device=grp.device)
                  for grp in cache.groups}
    slots: dict[str, int] = {}
    for grp in cache.groups:
        if grp.compute in (torch.float16, torch.bfloat16):
            device = str(grp.device)
            grp.guard_slot = slots.get(device, 0)
            slots[device] = grp.guard_slot + grp.chunks
    cache.guards = {device: _Guard(torch.zeros(k, dtype=torch.float32, device=device),
                                   torch.zeros(k, dtype=torch.int64, device=device))
                    for device, k in slots.items()}
    dtypes = {e.work.dtype for e in entries} | {e.grad.dtype for e in entries}
    dtypes |= {grp.compute for grp in cache.groups}
    cache.kernel_dtypes = dtypes <= set(ops.CUDA_KERNEL_DTYPES)  # once per plan, not per step
    cache.signature = _signature(entries, groups)


def _buffer_shape(p: Tensor, layout: str) -> tuple[int, ...]:
    """``state["momentum_buffer"]``'s shape: the parameter's, or (K * out, in) for a
    ``transposed_split:K`` parameter stored (in, K * out)."""
    return tuple(p.mT.shape) if layout.startswith("transposed_split") else tuple(p.shape)


def planted(cache: StepCache) -> bool:
    """Every momentum buffer is still the bank view the plan planted (``load_state_dict`` and
    ``reset_state`` replace them)."""
    return all(st.get("momentum_buffer") is view for st, view in cache.views)


def lean_muon_step(cache: StepCache, groups: list[dict[str, Any]],
                   entries: list[StepEntry]) -> None:
    """One Muon step over ``entries``, one per matrix in a stable order."""
    if not entries:
        return
    if torch.compiler.is_compiling():
        # Traced: dynamo guards on the tensors and the groups; rebuilding inside a graph would
        # allocate banks there, so a plan must exist (the first eager step, or `warmup`).
        fresh = cache.signature is None
    else:
        fresh = cache.signature != _signature(entries, groups) or not planted(cache)
    if fresh:
        _build(cache, entries, groups)
    for g in cache.groups:  # this step's gradients (and work copies, for written-back layouts)
        for part in g.parts:
            part.params = [entries[i].work for i in part.entries]
            part.grads = [entries[i].grad for i in part.entries]
    if _fused_passes(cache):
        _fused_step(cache, groups)
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
                                                    Tensor | None]:
    """The cautious mask on the fused route: one ``muon_lean_cautious_count_`` call over every
    rescaled cautious matrix of the step (zeroing + 1 launch per 128 matrices); the update masks
    and rescales as it writes. Returns ``{(id(chunk), slot): (gradient view, kept index)}`` and
    the counts. Instead of a ``cautious_mask_`` call per group (3 launches: zero, count, apply)
    and its read + write of the NS result. Chunks whose NS result is not laid out like the
    gradient bank (the kernels read both through one pair of strides) keep that op."""
    plan: dict[tuple[int, int], tuple[Tensor, int]] = {}
    values, grads = [], []
    for c in chunks:
        group = groups[c.g.pgs[0]]
        if not group["cautious"] or c.orth.stride() != c.G.stride():
            continue
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
    return plan, kept


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


def _fused_step(cache: StepCache, groups: list[dict[str, Any]]) -> None:
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
        masks, kept = _cautious_counts(done, groups, count, device)
        none = torch.empty(0, dtype=torch.float32, device=device)  # no launch
        up = _UpdateCall(kept=kept)
        for c in done:
            flag = verdict.get(id(c))
            if flag is not None:
                up.skip = flag[0]  # one guard tensor per device: every chunk's flags in it
            folded = any(key[0] == id(c) for key in masks)
            for pt, slab in _update_slabs(c.g, groups[c.g.pgs[0]], c.pieces, c.start, c.G,
                                          c.orth, fused=True, mask=not folded):
                for k in range(slab.stop - slab.start):
                    slot = slab.start + k
                    up.params.append(pt.params[slot - pt.start])
                    up.updates.append(slab.value[k])
                    up.hyper_index.append(pos[pt.pg])
                    up.scales.append(float(pt.lr_scale))
                    up.skip_index.append(-1 if flag is None else flag[1])
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
    """16-bit NS results: a chunk whose result is not finite gets no update this step (its
    weight decay stays), and its slot's hit count grows; no host sync. With ``fill`` the bad
    chunks' results are zeroed here; without, ``{id(chunk): (bad flags, index)}`` is returned
    for the fused update to read."""
    verdict: dict[int, tuple] = {}
    by_device: dict[str, list[_Chunk]] = {}
    for c in chunks:
        if c.g.guard_slot is not None:
            by_device.setdefault(str(c.g.device), []).append(c)
    for device, guarded in by_device.items():
        guard = cache.guards[device]
        slots = [c.g.guard_slot + c.start // c.g.chunk for c in guarded]
        for c, slot in zip(guarded, slots, strict=True):
            if c.orth.dtype == torch.bfloat16:
                # bf16 has fp32's range, so its own sum cannot overflow; on CPU a bf16 sum into
                # fp32 was 30x slower than a bf16 sum (48 x 768^2: 79 vs 2.4 ms)
                guard.sums[slot].copy_(c.orth.sum())
            else:  # fp16: summed in fp32 (an fp16 sum of finite entries could overflow)
                torch.sum(c.orth, dim=tuple(range(c.orth.dim())), dtype=torch.float32,
                          out=guard.sums[slot])
        lo, hi = min(slots), max(slots) + 1  # contiguous: all slots, or one chunk's
        # A 16-bit result is finite iff its fp32 sum is (|entries| < 4: no overflow), and
        # x * 0 is NaN exactly for a non-finite x: 2 small ops instead of isfinite's 4.
        bad = guard.sums[lo:hi].mul(0).isnan()                        # (hi - lo,) bool
        guard.hits[lo:hi].add_(bad)
        for c, slot in zip(guarded, slots, strict=True):
            if fill:
                c.orth.masked_fill_(bad[slot - lo], 0)
            else:
                verdict[id(c)] = (bad, slot - lo)
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
    if muon_plus:
        normalize = ops.kernel_or_fallback("muon_plus_normalize", orth.device, [torch.float32])
    if muon_plus and any(pt.flip for pt, _, _ in pieces):
        # Mixed orientations: normalize each piece in its logical orientation, (k, m, n) or
        # (k, n, m), and hand that straight to the update (no copy back, no cat: 2 launches
        # fewer).
        out = []
        orth = orth.float()                                            # (c, m, n) fp32
        for pt, s, e in pieces:
            bank = orth[s - start:e - start]                           # (k, m, n)
            # contiguous in, contiguous out, on every path (the kernel copies a strided input
            # anyway, and the op's fake kernel promises a contiguous result)
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


def _cautious(orth: Tensor, G: Tensor, group: dict[str, Any], shape: tuple[int, int]) -> Tensor:
    """Zero the entries of ``orth (k, m, n) fp32`` whose sign disagrees with ``G``, rescaled
    by ``numel / (kept + 1)`` per matrix with ``cautious_rescale``."""
    rescale = bool(group["cautious_rescale"])
    if orth.device.type in ("cuda", "meta"):
        # One fused op (1-3 launches) for the whole chunk instead of 5-7 elementwise passes;
        # in place: orth is this step's own buffer (NS output or a Muon+ result)
        mask_ = ops.kernel_or_fallback("cautious_mask_", orth.device, [orth.dtype, G.dtype])
        mask_(list(orth.unbind(0)), list(G.contiguous().unbind(0)), rescale)  # 1 copy at most
        return orth
    # CPU: batched over the chunk (the op's PyTorch body goes one matrix at a time)
    mask = (orth * G) > 0
    if rescale:
        kept = mask.sum(dim=(-2, -1), keepdim=True)                    # (k, 1, 1) int64
        return orth * mask * ((shape[0] * shape[1]) / (kept + 1))
    return orth * mask
