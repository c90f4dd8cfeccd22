"""Muon: a drop-in for ``torch.optim.Muon`` with batched Newton-Schulz, Muon+ and cautious.

Per parameter ``W`` (``A x B``) with gradient ``g`` and fp32 momentum buffer ``M``, exactly the
update of ``torch.optim.Muon`` (torch 2.13, ``_single_tensor_muon``):

    M   <- mu M + (1 - mu) g                      (EMA, torch's lerp form)
    U   <- g + mu (M - g)  if nesterov  else  M
    O   <- NS_k(U / max(||U||_F, eps))            (Newton-Schulz, ``ns_steps`` iterations)
    O   <- post(O)                                (Muon+ normalize; cautious mask vs g)
    W   <- W (1 - lr wd) - lr * s(A, B) * O       (s: ``adjust_lr_fn``)

The speed comes from doing this per *shape group* instead of per parameter: matrices of one
wide shape (a tall one joins transposed) share persistent banks and go through ONE batched
``newton_schulz`` call, with a few dozen whole-step ops around it (see :mod:`.muon_step`).
NS runs in fp32 on CPU (torch forces bf16 there, ~40x slower and ~1e-2 less accurate) and fp16
on CUDA (3-7x more accurate than bf16, benchmarks/results/gram_restarts.md; overflow-free, see
:mod:`speedtronic.kernels.newton_schulz`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from ..kernels import ops
from ._state import (
    EagerMethodsMixin,
    Fp32StateMixin,
    checked_or_dropped,
    fill_group_defaults,
    run_closure,
)
from .dtensor_step import dtensor_muon_step, is_dtensor
from .muon_groups import (  # noqa: F401  (_check_dtensor re-exported: its old home)
    MUON_DEFAULTS,
    _check_dtensor,
    _check_group,
    parse_layout,
    resolve_ns_dtype,
)
from .muon_step import (
    StepCache,
    StepEntry,
    adjusted_lr_scale,
    lean_muon_step,
    planted,
    tensorize_hyper,
)

logger = logging.getLogger("speedtronic.optim")

__all__ = ["Muon", "muon_step", "adjusted_lr_scale", "MUON_DEFAULTS", "parse_layout",
           "resolve_ns_dtype"]


def _step_entries(state: dict, groups: Sequence[dict[str, Any]],
                  writebacks: list[tuple[Tensor, Tensor]]) -> list[StepEntry]:
    """One :class:`~.muon_step.StepEntry` per matrix of the step, in a stable order (group by
    group, parameter by parameter).

    ``work`` is what the step updates in place: the parameter itself, a row block of it
    (``split:K``), its ``(out, in * prod(k))`` view (``flatten``) or a contiguous copy listed in
    ``writebacks`` as ``(source, destination)`` for after the step (``transposed_split:K``
    column blocks, a channels_last kernel, any other non-contiguous parameter). ``momentum`` is
    the matching view of ``state["momentum_buffer"]``, or None before the first step."""
    entries: list[StepEntry] = []
    for index, group in enumerate(groups):
        kind, k = parse_layout(group.get("layout", "matrix"))
        for p in group["params"]:
            g = p.grad
            if g is None or is_dtensor(p):  # DTensor (FSDP2) parameters: dtensor_step.py
                continue
            if torch.is_complex(p) or torch.is_complex(g):
                raise RuntimeError(f"Muon does not support complex parameters (shape "
                                   f"{tuple(p.shape)}, dtype {p.dtype}); route it to AdamW")
            if g.is_sparse:
                raise RuntimeError(f"Muon does not support sparse gradients (parameter shape "
                                   f"{tuple(p.shape)}); use a dense gradient or route it to "
                                   "AdamW")
            st = state[p]
            # None on first use: the step's bank starts it at zero (fp32 whatever the parameter
            # dtype: bf16 momentum loses the small updates), with no per-parameter copy.
            buf = st.get("momentum_buffer")
            if kind == "transposed_split":
                if buf is not None and buf.shape != p.mT.shape:
                    raise RuntimeError(f"Muon layout transposed_split:{k}: momentum buffer of "
                                       f"shape {tuple(buf.shape)} does not match the (K * out, "
                                       f"in) = {tuple(p.mT.shape)} layout of this parameter")
                cols = p.shape[1] // k
                for i in range(k):
                    block = slice(i * cols, (i + 1) * cols)
                    work = p[:, block].mT.contiguous()            # (out, in) copy
                    writebacks.append((work.mT, p[:, block]))
                    entries.append(StepEntry(index, p, i, k, work, g[:, block].mT.contiguous(),
                                             st, None if buf is None else buf[block]))
            elif kind == "flatten":
                work = p
                if not p.is_contiguous():  # a conv kernel in channels_last: a contiguous copy
                    work = p.contiguous()                         # (out, in, *k) copy
                    writebacks.append((work, p))
                entries.append(StepEntry(index, p, 0, 1, work.view(p.shape[0], -1),
                                         g.reshape(p.shape[0], -1), st,
                                         None if buf is None else buf.view(p.shape[0], -1)))
            else:  # matrix, transposed, split
                work = p
                if not p.is_contiguous():  # e.g. a transposed view: updated in place
                    work = p.contiguous()                         # same shape, contiguous copy
                    writebacks.append((work, p))
                if kind == "split":
                    rows = p.shape[0] // k
                    entries.extend(StepEntry(index, p, i, k, work[i * rows:(i + 1) * rows],
                                             g[i * rows:(i + 1) * rows], st,
                                             None if buf is None
                                             else buf[i * rows:(i + 1) * rows])
                                   for i in range(k))
                else:
                    entries.append(StepEntry(index, p, 0, 1, work, g, st, buf))
    return entries


def muon_step(state: dict, groups: Sequence[dict[str, Any]],
              cache: StepCache | None = None) -> None:
    """Apply one Muon step to ``groups`` (param-group dicts with :data:`MUON_DEFAULTS` keys).

    Matrices are grouped by wide shape across groups (a tall one joins transposed); each
    group is one gather, one batched ``newton_schulz`` call and one update pass (see
    :mod:`.muon_step`). Pass the optimizer's ``cache`` to keep the banks between steps;
    without one they are rebuilt (correct, but each call copies the momentum once more)."""
    sharded = [[p for p in g["params"] if is_dtensor(p)] for g in groups]
    if any(sharded):  # FSDP2: those matrices take the DTensor step, the rest the lean one
        if cache is not None and cache.shard is not None:
            raise ValueError("Muon: process_group= (the sharded data-parallel step) and "
                             "DTensor (FSDP2) parameters cannot be combined: FSDP2 already "
                             "shards the parameters; drop process_group")
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise ValueError("Muon: DTensor (FSDP2) parameters cannot run inside a CUDA graph "
                             "(their step all-gathers); set cuda_graph=False")
        dtensor_muon_step(state, list(groups), sharded)
    writebacks: list[tuple[Tensor, Tensor]] = []
    entries = _step_entries(state, groups, writebacks)
    lean_muon_step(cache if cache is not None else StepCache(), list(groups), entries, state)
    for source, destination in writebacks:  # transposed_split / channels_last copies
        destination.copy_(source)


def check_cuda_graph(value: bool | str, process_group: Any = None) -> bool | str:
    """``cuda_graph``: True, False or ``"auto"``; not with a ``process_group`` (a captured
    all-gather is untested here, so it is refused rather than left to chance)."""
    if not (isinstance(value, bool) or value == "auto"):
        raise ValueError(f"cuda_graph must be True, False or 'auto', got {value!r}")
    if value and process_group is not None:
        raise ValueError("cuda_graph with process_group (the sharded step) is not supported yet: "
                         "use one of them")
    return value


class MuonCacheMixin:
    """Holds the lean step's :class:`StepCache` (not part of ``state_dict``: it is rebuilt
    from the momentum buffers whenever they, or the matrix set, change)."""

    workspace_budget: int | None = None
    cuda_graph: bool | str = False
    process_group: Any = None

    def run_muon_step(self, state: dict, groups: list[dict[str, Any]]) -> None:
        """The lean step over ``groups`` (Muon groups only), eager or as a CUDA graph."""
        cache = self.muon_cache
        if not self.cuda_graph:
            muon_step(state, groups, cache)
            return
        from .cuda_graph import GraphState, graphed_step

        graph = self.__dict__.get("_muon_graph")
        if graph is None:
            graph = self.__dict__["_muon_graph"] = GraphState(
                mode="auto" if self.cuda_graph == "auto" else "on")
        graphed_step(graph, groups, lambda: muon_step(state, groups, cache),
                     lambda: planted(cache, state))

    def drop_muon_plan(self) -> None:
        """Forget the step's plan and its CUDA graph: the next step builds new banks from
        the momentum buffers in ``state`` (none: zeros). ``load_state_dict`` and
        ``reset_state`` call it, so a compiled step (which does not re-check the plan) and a
        captured graph (which would replay the old banks) see the new state too."""
        self._new_muon_cache()
        self.__dict__.pop("_muon_graph", None)

    def _new_muon_cache(self) -> None:
        """An empty plan, made here rather than at the first step: a cache first written inside
        ``torch.compile(opt.step)`` broke the compile on torch 2.11 (Dynamo refused a new
        attribute on the optimizer); 2.12 and later accept it."""
        from .sharded import shard_spec

        self.__dict__["_muon_cache"] = StepCache(self.workspace_budget,
                                                 shard=shard_spec(self.process_group))

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)  # type: ignore[misc]
        self.drop_muon_plan()

    @property
    def muon_cache(self) -> StepCache:
        cache = self.__dict__.get("_muon_cache")
        if cache is None:  # unpickled: torch's Optimizer.__getstate__ keeps no other attribute
            self._new_muon_cache()
            cache = self.__dict__["_muon_cache"]
        return cache

    def nonfinite_counts(self) -> list[tuple[tuple[int, int], int]]:
        """Matrix updates skipped because their 16-bit Newton-Schulz result was not finite, per
        shape group: ``[(shape, count)]``, empty when none. Such a matrix keeps its weight
        decay and gets no update; the rest of its group updates as usual. A non-finite gradient
        is the cause and stays in that matrix's momentum, so it is skipped every step until
        :meth:`restart_nonfinite_momentum`. Reads device counters: call it where values are
        read anyway (log steps)."""
        return self.muon_cache.nonfinite_counts()

    def restart_nonfinite_momentum(self) -> int:
        """Zero the momentum of the matrices the 16-bit guard keeps skipping (their momentum is
        not finite), so they train again from their next finite gradient; returns how many.
        One pass over the momentum and one host read: call it when :meth:`nonfinite_counts`
        grew (the trainer does, at its log steps)."""
        return self.muon_cache.restart_nonfinite_momentum()



class Muon(MuonCacheMixin, Fp32StateMixin, EagerMethodsMixin, torch.optim.Optimizer):
    """Muon with every ``torch.optim.Muon`` argument (same names, meaning and defaults), plus:

    Args:
        ns_coefficients: 3 floats (torch's form), ``3 * ns_steps`` floats, or a schedule name
            (``"quintic"``, ``"polar_express"``).
        muon_plus: Muon+ (arXiv 2602.21545): normalize each row, then each column, of the
            orthogonalized update (parameter layout) before applying it.
        norm_eps: epsilon inside the square roots of the Muon+ normalization.
        cautious: zero update entries whose sign disagrees with the gradient (applied to the
            orthogonalized update, where the mask density rescale matters).
        cautious_rescale: rescale kept entries by ``numel / (kept + 1)`` (Cautious Optimizers).
        ns_dtype: Newton-Schulz matmul dtype: ``"auto"``/None (fp16 on CUDA, fp32 on CPU),
            ``"bf16"``, ``"fp16"``, ``"fp32"``, ``"fp64"`` or a torch dtype.
        cuda_graph: capture the whole step as one CUDA graph after a few eager steps and replay
            it (see :mod:`~speedtronic.optim.cuda_graph` for what invalidates it); off on CPU
            and under ``torch.compile``, with one log line saying why. ``"auto"``: time 3 eager
            steps and 3 replays and keep whichever is faster (one host sync, once).
        workspace_budget: bytes the step's workspaces may take (gather bank, NS input and
            temporaries); None = :func:`~speedtronic.optim.muon_step.default_budget_bytes`
            (8% of the device's memory, 256 MiB to 16 GiB). A shape group that does not fit runs
            in chunks: less memory, more launches.
        process_group: under data parallelism (every rank steps on the same averaged
            gradients), split the Newton-Schulz work: each rank orthogonalizes 1/W of every
            shape group and an all-gather shares the results (:mod:`~speedtronic.optim.sharded`);
            parameters stay bitwise equal across ranks and to the replicated step. None = each
            rank does all of it.

    ``lr``, ``weight_decay`` and ``momentum`` are held as 0-d fp32 tensors on the parameters'
    device (floats are converted when the group is added; an LR scheduler then fills them in
    place), so a compiled or CUDA-graph-captured step reads the current values.

    State per parameter: ``momentum_buffer`` (fp32, the EMA buffer, same key and meaning as
    torch's; a view into its shape group's bank), independent of whether CUDA kernels load.
    """

    def __init__(self, params: Any, lr: float | Tensor = 1e-3, weight_decay: float = 0.1,
                 momentum: float = 0.95, nesterov: bool = True,
                 ns_coefficients: str | Sequence[float] = ops.QUINTIC, eps: float = 1e-7,
                 ns_steps: int = 5, adjust_lr_fn: str | None = None, *, muon_plus: bool = False,
                 norm_eps: float = 1e-8, cautious: bool = False, cautious_rescale: bool = True,
                 ns_dtype: str | torch.dtype | None = "auto", cuda_graph: bool | str = False,
                 workspace_budget: int | None = None, process_group: Any = None) -> None:
        if workspace_budget is not None and (isinstance(workspace_budget, bool)
                                             or not isinstance(workspace_budget, int)
                                             or workspace_budget <= 0):
            raise ValueError(f"workspace_budget must be a positive int of bytes or None, got "
                             f"{workspace_budget!r}")
        self.workspace_budget = workspace_budget
        self.cuda_graph = check_cuda_graph(cuda_graph, process_group)
        self.process_group = process_group
        self._new_muon_cache()
        defaults = dict(lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
                        ns_coefficients=ns_coefficients, eps=eps, ns_steps=ns_steps,
                        adjust_lr_fn=adjust_lr_fn, muon_plus=muon_plus, norm_eps=norm_eps,
                        cautious=cautious, cautious_rescale=cautious_rescale,
                        ns_dtype=resolve_ns_dtype(ns_dtype))
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """torch's, then the group's own values are checked (torch.optim.Muon checks only its
        constructor's, and less: here also momentum < 1, eps and norm_eps > 0, 2-D parameters as
        the group's ``layout`` allows) and a rejected group is removed again.
        ``lr``, ``weight_decay`` and ``momentum`` become 0-d fp32 tensors on the parameters'
        device, which an LR scheduler then fills in place."""
        super().add_param_group(param_group)
        checked_or_dropped(self.param_groups, _check_group)
        tensorize_hyper(self.param_groups[-1])

    def __setstate__(self, state: dict[str, Any]) -> None:
        # load_state_dict ends here: a torch.optim.Muon state dict has no muon_plus, norm_eps,
        # cautious, cautious_rescale or ns_dtype; its groups take this optimizer's defaults.
        super().__setstate__(state)
        fill_group_defaults(self.param_groups, lambda group: self.defaults)

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        """Perform one optimization step (``closure`` re-evaluates the loss, as in torch)."""
        loss = run_closure(closure)
        self.run_muon_step(self.state, self.param_groups)
        return loss
