"""The lean Muon step's plan: which matrices share a Newton-Schulz batch, and the banks that
stay allocated between steps.

Matrices are grouped by their wide shape and settings (:func:`_build`); each group owns its
momentum bank (``state["momentum_buffer"]`` is a view into it) and, allocated on first use, its
gradient and Newton-Schulz banks. The workspace budget decides how many matrices one batch
takes (:func:`default_budget_bytes`). Hyper-parameters become 0-d device tensors here
(:func:`hyper_tensor`). What runs on the plan: ``muon_chunks`` (the batched torch route) and
``muon_fused`` (the extension's fused passes), chosen in ``muon_step``.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from torch import Tensor

from ..kernels import ops
from ..kernels.newton_schulz import Workspace

__all__ = ["HYPER_KEYS", "NS_DTYPES", "StepCache", "StepEntry", "adjusted_lr_scale",
           "default_budget_bytes", "hyper_tensor", "planted", "tensorize_hyper",
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
    guard_slot: int | None = None    # 16-bit NS: its first matrix's slot in the device's guard
    gathered: Tensor | None = None   # sharded NS: the all-gather buffer (W * per, m, n)
    slot_pg: Tensor | None = None    # (b,) int64: index into pgs per slot, when len(pgs) > 1
    ns_workspace: Workspace | None = None  # eager CPU steps only (kernels.newton_schulz)

    @property
    def chunks(self) -> int:
        """Newton-Schulz batches per step."""
        return math.ceil(self.momentum.shape[0] / self.chunk)


@dataclass
class _Guard:
    """The 16-bit Newton-Schulz guard of one device: one slot per guarded matrix."""

    sums: Tensor               # (K,) fp32: this step's sum of each matrix's NS result
    hits: Tensor               # (K,) int64: steps whose result for that matrix was not finite


@dataclass
class StepCache:
    """What a Muon optimizer keeps between steps: the groups and their banks, keyed by the
    step's matrix set. Any change (a new parameter, a group setting, ``load_state_dict``, a
    momentum buffer replaced) rebuilds it, copying the current momentum into new banks."""

    budget_bytes: int | None = None
    shard: Any = None  # sharded.ShardSpec: Newton-Schulz split across data-parallel ranks
    signature: tuple | None = None
    groups: list[_Group] = field(default_factory=list)
    views: list[tuple[Tensor, Tensor]] = field(default_factory=list)  # (param, planted view)
    guards: dict[str, _Guard] = field(default_factory=dict)  # per device, 16-bit NS only
    ones: dict[str, Tensor] = field(default_factory=dict)    # per device: a 0-d fp32 one
    kernel_dtypes: bool = False  # every parameter, gradient and NS dtype has a CUDA kernel

    def guard_counters(self) -> list[tuple[tuple[int, int], Tensor]]:
        """``(shape, 0-d int64 device tensor)``: the 16-bit guard's hit count of each guarded
        group, for a caller that reads it together with other device values (no sync here)."""
        return [(g.shape, self.guards[str(g.device)].hits[g.guard_slot:g.guard_slot
                                                          + g.momentum.shape[0]].sum())
                for g in self.groups if g.guard_slot is not None]

    def restart_nonfinite_momentum(self) -> int:
        """Zero the momentum of every guarded matrix whose momentum is not finite (a non-finite
        gradient reached it; the guard skips that matrix each step until then). One pass over
        the guarded banks and one host read: call it where the guard's counters were seen to
        grow, not every step. Returns how many matrices restarted."""
        restarted = []
        for g in self.groups:
            if g.guard_slot is None:
                continue
            bad = g.momentum.sum(dim=(-2, -1)).mul(0).isnan()         # (b,) bool
            g.momentum.masked_fill_(bad.view(-1, 1, 1), 0)
            restarted.append(bad.sum())
        return int(torch.stack(restarted).sum()) if restarted else 0

    def nonfinite_counts(self) -> list[tuple[tuple[int, int], int]]:
        """``(shape, skipped matrix updates: non-finite 16-bit results)`` per group with a hit
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
                cache.views.append((p, view))
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
            slots[device] = grp.guard_slot + grp.momentum.shape[0]
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


def planted(cache: StepCache, state: Mapping[Tensor, dict]) -> bool:
    """Every momentum buffer in the optimizer's *current* ``state`` is still the bank view the
    plan planted. Looked up in ``state`` itself, not in the per-parameter dicts the plan saw:
    ``load_state_dict`` replaces those dicts and ``state.clear()`` (``reset_state``) drops them,
    and a check on the old dicts kept stepping the old momentum after either."""
    for p, view in cache.views:
        st = state.get(p)  # .get: a defaultdict must not grow an entry here
        if st is None or st.get("momentum_buffer") is not view:
            return False
    return True
