"""FSDP2 (``torch.distributed.fsdp.fully_shard``) for ``torchrun speedtronic train``
(``data_parallel.fsdp: true``): what is refused, how the model is sharded, how a step's
micro-batches synchronize, how the gradient norm is read, and how checkpoints stay in the plain
one-process format.

Why: under DDP every rank holds the whole model, its gradients and its optimizer state. FSDP2
keeps 1/world of each on every rank (parameters are ``DTensor`` row shards, ``Shard(0)``) and
all-gathers one unit's parameters just before it runs, in forward and again in backward; the
gradients are reduce-scattered back to their shards. Our Muon takes those DTensor parameters as
they are (:mod:`speedtronic.optim.dtensor_step` all-gathers each matrix's fp32 blend for
Newton-Schulz and splits that work over the ranks itself), AdamW is elementwise on the shards.

* **units**: every block of the model's block list (the largest ``nn.ModuleList`` of
  same-typed modules: the reference model's ``blocks``, an HF model's ``layers``/``h``) is one
  unit, the root (embedding, final norm, head) another, so a tied embedding / head weight lives
  in one unit. A block whose parameters are also used outside it stays in the root's unit.
* **token weighting**: FSDP2's reduce-scatter averages over ranks as DDP's all-reduce does, so
  :func:`speedtronic.distributed.ddp.step_scales` applies unchanged (the parity test checks it).
* **accumulation**: ``set_requires_gradient_sync(False)`` for every micro-batch but a step's
  last (FSDP2's ``no_sync``: unsharded gradients accumulate, one reduce-scatter per step).
* **precision**: parameters stay fp32 (no ``MixedPrecisionPolicy``): the trainer's autocast
  runs on the gathered fp32 weights as it does without FSDP. fp16 with a GradScaler is refused.
* **checkpoints**: every DTensor is gathered (``full_tensor``, a collective every rank joins in
  the same order) and rank 0 writes the plain format, so the weights load in one process; on
  resume every rank reads the file and keeps its own rows (a local slice, no communication).
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

import torch
from torch import nn

from ..config import SpeedtronicConfig
from ..config.combinations import check_fsdp
from .process_group import DataParallel

logger = logging.getLogger("speedtronic.distributed")

__all__ = ["check_fsdp", "wrap_model_fsdp", "block_list", "sync_context", "grad_norm",
           "full_state", "full_model_state", "shard_like", "shard_model_state",
           "shard_optimizer_state", "all_finite", "is_sharded"]


def block_list(model: nn.Module) -> nn.ModuleList | None:
    """The model's list of transformer blocks: the ``nn.ModuleList`` with the most parameters
    whose entries are all of one type (None when there is none)."""
    best, best_size = None, 0
    for module in model.modules():
        if not isinstance(module, nn.ModuleList) or len(module) == 0:
            continue
        if len({type(m) for m in module}) != 1:
            continue
        size = sum(p.numel() for p in module.parameters())
        if size > best_size:
            best, best_size = module, size
    return best


def wrap_model_fsdp(model: nn.Module, dp: DataParallel, cfg: SpeedtronicConfig) -> nn.Module:
    """``fully_shard`` every block of ``model`` (on ``dp.device``), then the root; returns the
    same module, now an FSDP module whose parameters are DTensor row shards. Build the
    optimizer after this (it must hold the sharded parameters)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(dp.device.type, (dp.world_size,))
    blocks = block_list(model)
    units = 0
    if blocks is not None:
        in_blocks = {id(m) for m in blocks.modules()}
        outside = {id(p) for m in model.modules() if id(m) not in in_blocks
                   for p in m.parameters(recurse=False)}  # a tied weight shows up here too
        for block in blocks:
            if any(id(p) in outside for p in block.parameters()):
                logger.warning("fsdp: a block shares a parameter with the rest of the model; "
                               "it stays in the root's unit")
                continue
            # the last block's parameters are gathered again at once in backward: keep them
            fully_shard(block, mesh=mesh, reshard_after_forward=block is not blocks[-1])
            units += 1
    fully_shard(model, mesh=mesh)
    logger.info("data parallel: FSDP2: %d block unit(s) + the root over %d ranks; parameters, "
                "gradients and optimizer state ~1/%d per rank", units, dp.world_size,
                dp.world_size)
    return model


def is_sharded(model: nn.Module) -> bool:
    """True when ``fully_shard`` was applied to ``model`` (its root)."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def sync_context(model: nn.Module, sync: bool) -> contextlib.AbstractContextManager:
    """Turn the gradient reduce-scatter off for every micro-batch but a step's last."""
    model.set_requires_gradient_sync(sync)  # type: ignore[operator]
    return contextlib.nullcontext()


def _plain(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def grad_norm(params: list[torch.Tensor], clip: float | None) -> torch.Tensor | None:
    """The global 2-norm of the DTensor gradients of ``params`` as a plain device scalar (one
    all-reduce of partial norms, no host read), after clipping to ``clip`` when given."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return None
    norm = _plain(torch.nn.utils.get_total_norm(grads, 2.0))
    if clip is not None:
        torch.nn.utils.clip_grads_with_norm_(params, clip, norm)
    return norm


def all_finite(tensors: list[torch.Tensor], dp: DataParallel) -> torch.Tensor:
    """Device bool: every local shard of ``tensors`` is finite on every rank (one all-reduce)."""
    from torch.distributed.tensor import DTensor

    local = [t.to_local() if isinstance(t, DTensor) else t for t in tensors]
    peaks = torch._foreach_norm([t.detach() for t in local if t.numel()], ord=float("inf"))
    bad = (~torch.isfinite(torch.stack([t.float() for t in peaks]))).sum().float()
    return dp.all_reduce_sum(bad) == 0


def full_state(state: Any, keep: bool) -> Any:
    """``state`` (nested dicts / lists of tensors) with every DTensor gathered whole. Every rank
    must call it on the same structure (the gathers are collectives); only where ``keep`` are
    the gathered tensors returned (moved to the host), elsewhere they are dropped at once."""
    from torch.distributed.tensor import DTensor

    def walk(v: Any) -> Any:
        if isinstance(v, DTensor):
            full = v.full_tensor()
            return full.cpu() if keep else None
        if isinstance(v, dict):
            return {k: walk(x) for k, x in v.items()}
        if isinstance(v, list):
            return [walk(x) for x in v]
        return v

    return walk(state)


def full_model_state(model: nn.Module, keep: bool) -> dict[str, Any]:
    """``model.state_dict()`` gathered as :func:`full_state` does, a tied weight once: its
    second key holds the same tensor, as in a one-process checkpoint. The ties come from the
    module structure, so every rank skips the same gathers."""
    first: dict[int, str] = {}
    alias = {name: first.setdefault(id(p), name)
             for name, p in model.named_parameters(remove_duplicate=False)}
    out: dict[str, Any] = {}
    for key, value in model.state_dict().items():
        src = alias.get(key, key)
        out[key] = out[src] if src != key and src in out else full_state(value, keep)
    return out


def shard_like(full: torch.Tensor, like: Any) -> torch.Tensor:
    """This rank's shard of the whole tensor ``full`` laid out as the DTensor ``like`` (a local
    slice: every rank read the same file)."""
    from torch.distributed.tensor import DTensor, Replicate

    mesh = like.device_mesh
    full = full.to(device=like.to_local().device, dtype=like.dtype)
    replicated = DTensor.from_local(full, mesh, [Replicate()] * mesh.ndim, run_check=False)
    return replicated.redistribute(mesh, like.placements)


def shard_model_state(model: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, Any]:
    """A plain (one-process) model state dict laid out as ``model``'s sharded parameters."""
    from torch.distributed.tensor import DTensor

    own = model.state_dict()
    return {k: shard_like(v, own[k]) if isinstance(own.get(k), DTensor) else v
            for k, v in state.items()}


def shard_optimizer_state(optimizer: torch.optim.Optimizer,
                          state: dict[str, Any]) -> dict[str, Any]:
    """A plain optimizer state dict with each parameter's full-shape state tensors sharded as
    that parameter (parameter ids in ``param_groups`` order, as ``state_dict`` numbers them)."""
    from torch.distributed.tensor import DTensor

    params = [p for g in optimizer.param_groups for p in g["params"]]
    saved_ids = [i for g in state.get("param_groups", []) for i in g["params"]]
    by_id = dict(zip(saved_ids, params, strict=False))
    out = {}
    for pid, st in state.get("state", {}).items():
        p = by_id.get(pid)
        if p is None or not isinstance(p, DTensor) or not isinstance(st, dict):
            out[pid] = st
            continue
        out[pid] = {k: shard_like(v, p) if isinstance(v, torch.Tensor)
                    and tuple(v.shape) == tuple(p.shape) else v for k, v in st.items()}
    return {**state, "state": out}
