"""Muon matrices with one owner each under data parallelism: their gradients are
reduce-scattered to the owner, the owner alone keeps their momentum and runs their step, and the
updated matrices are all-gathered (``data_parallel.reduce_scatter_muon: true``).

Why: with DDP every rank receives every averaged gradient (a ring all-reduce, ``2 f 4 P``
bytes per rank for ``P`` fp32 gradient values, ``f = (W - 1) / W``) and then every rank runs
the same Muon step. ``shard_muon`` splits the Newton-Schulz but adds an all-gather of the
results on top (``+ f 2 P_m``: 1.17x DDP's bytes on GPT-2 small at W = 8). Here the ``P_m``
Muon values leave DDP: a reduce-scatter gives each rank the averaged gradients of the whole
matrices it owns (``f 4 P_m``), the owner runs momentum, Newton-Schulz, Muon+, the cautious
mask and the update for them alone, and an all-gather of the updated fp32 matrices (``f 4
P_m``) puts every rank back on the same weights. The rest stays in DDP's all-reduce (``2 f 4
(P - P_m)``), so the step sends exactly DDP's ``2 f 4 P`` (padding aside) for 1/W of the
Muon work: Newton-Schulz *and* the elementwise passes, which ``shard_muon`` still ran on
every rank. Muon's momentum per rank drops to ~1/W (ZeRO-1 for the Muon state).

What it costs: one persistent fp32 buffer of the ``P_m`` Muon values (the packed gradients,
reused for the parameter gather) and the owner's 1/W received share. With ~(W - 1)/W of the
momentum gone, W = 2 nets +0.5 ``P_m`` fp32 and W >= 3 saves memory.

Overlap: the reduce-scatter of a bucket (matrices of one shape, in the order backward finishes
them, at most ``bucket_cap_mb``) starts from a post-accumulate-grad hook as soon as its last
gradient lands in the step's last micro-batch (DDP's ``require_backward_grad_sync`` says which
one that is), so it runs behind the rest of the backward as DDP's bucketed all-reduce does.
The collectives use a group of their own, so their order cannot interleave with DDP's, and
buckets start in one plan order on every rank (a matrix unused on one rank delays the buckets
after it there, instead of misordering them). On gloo a bucket is all-reduced instead of
reduce-scattered (:data:`GLOO_REDUCE_SCATTER` has the measurement).

Ownership: tall matrices are packed transposed beside the wide ones of the same shape (GPT-2
small: 48 x 768^2 and 24 x 768 x 3072, no padding at W = 8), each bucket is cut into W
contiguous shares of ``ceil(b / W)`` whole matrices, and which rank takes which share rotates
by the running Newton-Schulz cost (``m^2 n`` per matrix), as :mod:`speedtronic.optim.sharded`
does per step: the ranks' costs differ by at most about one matrix. That plan is
:mod:`speedtronic.distributed.muon_ownership`; this module is the collective step around it.

The clip norm is the norm of the averaged gradients: each rank's owned share (squares summed,
one scalar all-reduce queued on the device, no host read) plus the replicated AdamW gradients.
Checkpoints gather the momentum (a collective every rank joins when the trainer builds its
state) and keep the plain single-process format: a run resumes with this on or off.

Not combined with fp16 (the loss scaler's overflow check would see only this rank's share),
``zero1``, ``fsdp``, ``optimizer.cuda_graph`` or torchft (refused with the reason:
:func:`check_reduce_scatter_muon`). A torchrun group that is one DiLoCo worker (hierarchical
DiLoCo) works: the relayed optimizer resets clear each owner's momentum
(tests/distributed/test_hierarchical.py). ``torch.compile`` of the DDP module composes (checked
by hand on 2 CPU ranks: the losses and evals of the eager run to 6 decimals).
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ..config import ConfigError, SpeedtronicConfig
from ..optim import HybridOptimizer
from ..optim.muon_plan import _buffer_shape
from .muon_ownership import (
    OwnershipPlanner,
    _Bucket,
    _cost,  # noqa: F401  (re-exported: the tests import it from here)
)

__all__ = ["OwnerShardedHybrid", "check_reduce_scatter_muon", "owner_sharded_optimizer"]

logger = logging.getLogger("speedtronic.distributed")

GLOO_REDUCE_SCATTER = False
"""On gloo, all-reduce each bucket and keep this rank's chunk instead of a reduce-scatter:
gloo's reduce-scatter of 18.9 MB took 21.1-21.6 ms against 12.7 ms for its all-reduce of the
same buffer (2 ranks, 1 thread each, benchmarks/results/gloo_collectives_cpu.md), so on
loopback the extra bytes are cheaper than gloo's reduce-scatter. NCCL always reduce-scatters.
Tests set this to exercise the reduce-scatter path on CPU."""


def check_reduce_scatter_muon(cfg: SpeedtronicConfig) -> None:
    """Refuse what the owner-sharded Muon step does not combine with, with the reason."""
    dp = cfg.data_parallel
    if not dp.reduce_scatter_muon:
        return
    key = "data_parallel.reduce_scatter_muon: true"
    clash = [
        (dp.zero1, "data_parallel.zero1: true", "ZeRO-1 partitions every parameter its own way"),
        (dp.fsdp, "data_parallel.fsdp: true", "FSDP2 shards the matrices by rows"),
        (cfg.optimizer.cuda_graph != "off", f"optimizer.cuda_graph: {cfg.optimizer.cuda_graph}",
         "the gather after the step is not part of a captured graph"),
        (cfg.precision.mode == "fp16", "precision.mode: fp16",
         "the loss scaler would check for overflow only in this rank's share of the Muon "
         "gradients, so ranks could disagree on skipping a step"),
        (cfg.torchft.mode != "off", f"torchft.mode: {cfg.torchft.mode}",
         "the average across replica groups needs every rank's whole gradient"),
    ]
    for on, what, why in clash:
        if on:
            raise ConfigError(f"{key} with {what}: {why}; turn one of them off")
    if cfg.optimizer.name != "muon":
        raise ConfigError(f"{key} needs optimizer.name: muon (got "
                          f"{cfg.optimizer.name!r}): it shards the Muon matrices")


def _reduce_scatter() -> Any:
    """torch 2.13 renamed ``reduce_scatter_tensor`` (and warns on the old name); 2.11, the
    H200's, only has the old one."""
    return getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _all_gather() -> Any:
    return getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class OwnerShardedHybrid(OwnershipPlanner, HybridOptimizer):
    """:class:`~speedtronic.optim.HybridOptimizer` whose Muon matrices each have one owning rank
    (see the module docstring). Build it with :func:`owner_sharded_optimizer`, wrap the model in
    DDP with :meth:`ddp_ignored_names` ignored, then :meth:`attach` the DDP module.

    Per step: :meth:`finish_gradients` (waits for the reduce-scatters; the owner's Muon
    ``.grad`` become its averaged share, the others ``None``), :meth:`clip_grad_norm_`, then
    ``step()`` (owned Muon matrices and every AdamW parameter, then the all-gather)."""

    def __init__(self, param_groups: list[dict[str, Any]], *, group: Any = None,
                 bucket_cap_mb: float = 25.0, workspace_budget: int | None = None) -> None:
        super().__init__(param_groups, workspace_budget=workspace_budget)
        self.comm = dist.new_group(backend=dist.get_backend(group)) if group is None else group
        self.world = dist.get_world_size(self.comm)
        self.rank = dist.get_rank(self.comm)
        self._ddp: nn.Module | None = None
        self._finished = False
        muon = [p for g in self.param_groups if g["kind"] == "muon" for p in g["params"]]
        self._layout = {p: g.get("layout", "matrix") for g in self.param_groups
                        if g["kind"] == "muon" for p in g["params"]}
        self.buckets = self._plan(muon, int(bucket_cap_mb * 2**20))
        self._next = 0  # buckets start in plan order: every rank issues them alike
        self._gather_whole = dist.get_backend(self.comm) == "gloo" and not GLOO_REDUCE_SCATTER
        self.owned = [b.params[i] for b in self.buckets for i in b.mine]
        self.others = [p for b in self.buckets for i, p in enumerate(b.params)
                       if i not in b.mine]
        self._adamw = [p for g in self.param_groups if g["kind"] == "adamw" for p in g["params"]]
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p in muon]
        self._bucket_of = {id(p): b for b in self.buckets for p in b.params}

    # ---- gradients -----------------------------------------------------------------------
    def attach(self, ddp: nn.Module | None) -> None:
        """Start reduce-scatters from backward hooks in the micro-batch where ``ddp`` syncs,
        and give every rank rank 0's Muon matrices (DDP does not broadcast what it ignores)."""
        self._ddp = ddp
        for b in self.buckets:
            for p in b.params:
                dist.broadcast(p.data, src=dist.get_global_rank(self.comm, 0), group=self.comm)

    @staticmethod
    def ddp_ignored_names(model: nn.Module, optimizer: OwnerShardedHybrid) -> list[str]:
        """Names of ``model``'s parameters that DDP must leave alone (the Muon matrices)."""
        ids = {id(p) for b in optimizer.buckets for p in b.params}
        return [name for name, p in model.named_parameters() if id(p) in ids]

    def _syncing(self) -> bool:
        return self._ddp is not None and bool(getattr(self._ddp, "require_backward_grad_sync",
                                                      True))

    def _on_grad(self, p: Tensor) -> None:
        if not self._syncing():
            return  # a no_sync micro-batch: the gradient keeps accumulating locally
        self._bucket_of[id(p)].ready += 1
        while self._next < len(self.buckets):  # every ready bucket, in plan order
            b = self.buckets[self._next]
            if b.ready < len(b.params):
                break
            self._launch(b)
            self._next += 1

    def _launch(self, b: _Bucket) -> None:
        """Pack ``grad / W`` (DDP's pre-division, so the sum rounds as its all-reduce does) and
        start the bucket's reduce-scatter."""
        if b.buffer is None:
            p0 = b.params[0]
            b.buffer = torch.empty((self.world * b.per, *b.packed), dtype=p0.dtype,
                                   device=p0.device)                  # (W * per, *packed)
            b.share = torch.empty((b.per, *b.packed), dtype=p0.dtype, device=p0.device)
        for i, slot in zip(range(len(b.params)), self._slots(b), strict=True):
            g = b.params[i].grad
            dst = b.view(b.buffer[slot], i)
            if g is None:  # no gradient on this rank: it adds nothing to the sum
                dst.zero_()
            else:
                torch.div(g, self.world, out=dst)
        self._zero_padding(b)
        if self._gather_whole:  # gloo: see GLOO_REDUCE_SCATTER
            b.work = dist.all_reduce(b.buffer, group=self.comm, async_op=True)
        else:
            b.work = _reduce_scatter()(b.share, b.buffer, group=self.comm, async_op=True)

    def _zero_padding(self, b: _Bucket) -> None:
        used = [0] * self.world
        for r in b.owner:
            used[r] += 1
        for r in range(self.world):
            if used[r] < b.per:
                b.buffer[r * b.per + used[r]:(r + 1) * b.per].zero_()

    def finish_gradients(self) -> None:
        """Wait for every bucket's reduce-scatter (starting those no hook started); then each
        owned Muon matrix's ``.grad`` is its averaged gradient and the others' is None."""
        if self._finished:
            return
        for b in self.buckets[self._next:]:  # those no hook started, in plan order
            self._launch(b)
        self._next = 0
        for b in self.buckets:
            b.work.wait()
            b.work, b.ready = None, 0
            assert b.share is not None and b.buffer is not None
            if self._gather_whole:
                b.share.copy_(b.buffer[self.rank * b.per:(self.rank + 1) * b.per])
            for j, i in enumerate(b.mine):
                b.params[i].grad = b.view(b.share[j], i)
        for p in self.others:
            p.grad = None
        self._finished = True

    def clip_grad_norm_(self, max_norm: float | None) -> Tensor:
        """The norm of the averaged gradients (a device scalar, not read on the host); with
        ``max_norm`` the gradients are scaled as ``torch.nn.utils.clip_grad_norm_`` does."""
        self.finish_gradients()
        shares = [b.share for b in self.buckets if b.share is not None]
        device = (shares[0] if shares else self._adamw[0]).device
        owned = torch.zeros((), dtype=torch.float32, device=device)
        if shares:  # padding slots are zero: whole shares may be summed
            owned = torch.stack([torch.linalg.vector_norm(s, dtype=torch.float32)
                                 for s in shares]).square().sum()
        dist.all_reduce(owned, group=self.comm)
        grads = [p.grad for p in self._adamw if p.grad is not None]
        rest = (torch.stack([torch.linalg.vector_norm(g, dtype=torch.float32) for g in grads])
                .square().sum() if grads else torch.zeros_like(owned))
        norm = (owned + rest).sqrt()
        if max_norm is not None:
            coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
            torch._foreach_mul_([*shares, *grads], coef.to(shares[0].dtype if shares
                                                          else grads[0].dtype))
        return norm

    # ---- step ----------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        """Owned Muon matrices and every AdamW parameter, then the all-gather of the Muon
        matrices (every rank ends on the owners' values)."""
        self.finish_gradients()
        loss = super().step(closure)
        works = []
        for b in self.buckets:
            assert b.buffer is not None and b.share is not None
            for j, i in enumerate(b.mine):
                b.view(b.share[j], i).copy_(b.params[i])
            works.append(_all_gather()(b.buffer, b.share, group=self.comm, async_op=True))
        for b, work in zip(self.buckets, works, strict=True):
            work.wait()
            assert b.buffer is not None
            for i, slot in enumerate(self._slots(b)):
                if b.owner[i] != self.rank:
                    b.params[i].copy_(b.view(b.buffer[slot], i))
        self._finished = False
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        self._finished = False

    # ---- state ---------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        """The plain :class:`HybridOptimizer` state dict with every Muon momentum (a
        collective: each owner's buffers are all-gathered; every rank gets the whole dict)."""
        have = [p for p in self.owned if "momentum_buffer" in self.state.get(p, {})]
        count = torch.tensor([len(have)], dtype=torch.int64)
        dist.all_reduce(count, group=self._control())
        if int(count) == 0:  # no step yet on any rank: nothing to gather
            return super().state_dict()
        added = []
        for b in self.buckets:
            numel = math.prod(b.packed)
            p0 = b.params[0]
            mine = torch.zeros((b.per, numel), dtype=torch.float32, device=p0.device)
            for j, i in enumerate(b.mine):
                buf = self.state.get(b.params[i], {}).get("momentum_buffer")
                if buf is not None:
                    mine[j].copy_(buf.reshape(-1))
            every = torch.empty((self.world * b.per, numel), dtype=torch.float32,
                                device=p0.device)
            _all_gather()(every, mine, group=self.comm)
            for i, slot in enumerate(self._slots(b)):
                p = b.params[i]
                if b.owner[i] != self.rank:
                    shape = _buffer_shape(p, self._layout[p])
                    self.state[p]["momentum_buffer"] = every[slot].view(shape).clone()
                    added.append(p)
        try:
            return super().state_dict()
        finally:
            for p in added:
                self.state.pop(p, None)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        for p in self.others:  # another rank owns it: its momentum lives there
            self.state.pop(p, None)
        self._finished = False

    def _control(self) -> Any:
        """A gloo group for the host-side count (the comm group may be NCCL)."""
        if dist.get_backend(self.comm) == "gloo":
            return self.comm
        if not hasattr(self, "_gloo"):
            self._gloo = dist.new_group(backend="gloo")
        return self._gloo

    def bytes_per_step(self) -> dict[str, int]:
        """Bytes each rank sends per step in a ring for the Muon buckets (padding included):
        the reduce-scatter (on gloo the all-reduce, twice as many) and the all-gather."""
        f = (self.world - 1) / self.world
        total = sum(self.world * b.per * math.prod(b.packed) * b.params[0].element_size()
                    for b in self.buckets)
        first = {"all_reduce": int(2 * f * total)} if self._gather_whole else \
            {"reduce_scatter": int(f * total)}
        return {**first, "all_gather": int(f * total)}


def owner_sharded_optimizer(optimizer: HybridOptimizer, *, bucket_cap_mb: float = 25.0,
                            group: Any = None) -> OwnerShardedHybrid:
    """Rebuild a freshly built :class:`HybridOptimizer` with owned Muon matrices (see the
    module docstring); logs what this rank owns."""
    if not isinstance(optimizer, HybridOptimizer):
        raise TypeError("owner_sharded_optimizer takes a HybridOptimizer, got "
                        f"{type(optimizer).__name__}")
    if optimizer.state:
        raise ValueError("owner_sharded_optimizer: build it before the first step (the "
                         "optimizer already holds state)")
    groups = [dict(g, params=list(g["params"])) for g in optimizer.param_groups]
    opt = OwnerShardedHybrid(groups, group=group, bucket_cap_mb=bucket_cap_mb,
                             workspace_budget=optimizer.workspace_budget)
    total = sum(len(b.params) for b in opt.buckets)
    elements = sum(p.numel() for b in opt.buckets for p in b.params)
    sent = opt.bytes_per_step()
    logger.info("data parallel: reduce-scatter Muon: rank %d of %d owns %d of %d matrices "
                "(%d of %d elements) in %d buckets; bytes sent per step: %s", opt.rank,
                opt.world, len(opt.owned), total, sum(p.numel() for p in opt.owned), elements,
                len(opt.buckets), ", ".join(f"{k.replace('_', '-')} {v}"
                                            for k, v in sent.items()))
    return opt
