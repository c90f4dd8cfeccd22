"""Muon on DTensor parameters (FSDP2 ``fully_shard``): the correct update, not yet a lean one.

Newton-Schulz needs each matrix whole; FSDP2 hands every rank a row shard of it. So per step:

1. momentum and the Nesterov blend on each rank's own shard (elementwise, fp32, local tensors);
2. one all-gather per matrix (``full_tensor``) of that fp32 blend ``U``; the cautious mask also
   gathers the gradient;
3. one batched Newton-Schulz per shape on the whole matrices, then Muon+ / the cautious mask on
   the whole result (both need whole rows or columns);
4. each rank keeps its own rows of the result (``redistribute`` from replicated to the
   parameter's placement slices locally, no communication) and updates its shard in place.

After the gather every rank holds the same whole matrices, so the Newton-Schulz is split as in
the sharded data-parallel step (:mod:`.sharded`): each rank orthogonalizes ``ceil(b / W)`` of a
shape group's ``b`` matrices and a second all-gather shares the results (``torch.optim.Muon``
under FSDP2 runs every matrix on every rank: W times the NS work). Communication per step: two
fp32 all-gathers of every Muon matrix, 8 bytes x its size (12 with the cautious mask).

The momentum buffer is a DTensor with the parameter's placement, so ``state_dict()`` holds it
sharded the way distributed checkpointing expects.
"""

from __future__ import annotations

import functools
import sys
from typing import Any

import torch
from torch import Tensor

from ..kernels import ops
from .muon_step import NS_DTYPES, adjusted_lr_scale, hyper_tensor
from .sharded import ShardSpec, sharded_orthogonalize

__all__ = ["dtensor_muon_step", "is_dtensor"]


def is_dtensor(p: Tensor) -> bool:
    """A ``torch.distributed.tensor.DTensor``. Not imported here (1.5 s on the 2-vCPU CI
    machine, and most runs never shard): without that module loaded no DTensor exists. A plain
    ``isinstance``: walking ``type(p).__mro__`` broke the ``torch.compile`` graph of the step."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(p, module.DTensor)


def _whole(local: Tensor, like: Any) -> Tensor:
    """All-gather the full matrix whose shard on this rank is ``local`` (laid out as ``like``)."""
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(local, like.device_mesh, like.placements, shape=like.shape,
                              stride=like.stride(), run_check=False).full_tensor()


def _my_rows(full: Tensor, like: Any) -> Tensor:
    """This rank's shard of ``full`` under ``like``'s placement (a local slice, no comm)."""
    from torch.distributed.tensor import DTensor, Replicate

    mesh = like.device_mesh
    replicated = DTensor.from_local(full, mesh, [Replicate()] * mesh.ndim, run_check=False)
    return replicated.redistribute(mesh, like.placements).to_local()


def _ns_split(like: Any, splits: dict[Any, ShardSpec | None]) -> ShardSpec | None:
    """The ranks that hold ``like``'s rows (the mesh dimension it is sharded over), which all
    see the same gathered matrices; None on one rank. One spec per process group and step
    (``splits``), so the shares rotate over the step's shape groups."""
    from torch.distributed.tensor import Shard

    dims = [i for i, pl in enumerate(like.placements) if isinstance(pl, Shard)]
    if not dims:
        return None
    group = like.device_mesh.get_group(dims[0])
    if group not in splits:
        spec = ShardSpec(group)
        splits[group] = spec if spec.world > 1 else None
    return splits[group]


def _orthogonalize(newton_schulz: Any, steps: int, coefficients: list[float], eps: float,
                   compute: torch.dtype | None, X: Tensor) -> Tensor:
    return newton_schulz(X, steps, coefficients, eps, compute, "auto", False).float()


def dtensor_muon_step(state: dict, groups: list[dict[str, Any]],
                      params: list[list[Tensor]]) -> None:
    """One Muon step over the DTensor parameters ``params[i]`` of ``groups[i]``."""
    splits: dict[Any, ShardSpec | None] = {}
    for group, group_params in zip(groups, params, strict=True):
        live = [p for p in group_params if p.grad is not None]
        if not live:
            continue
        device = live[0].to_local().device
        lr, wd, mu = (hyper_tensor(group, k, device) for k in ("lr", "weight_decay", "momentum"))
        eps = float(group["eps"])
        by_shape: dict[tuple[int, ...], list[tuple[Tensor, Tensor, Tensor | None]]] = {}
        for p in live:
            g_local = p.grad.to_local().float()                      # (rows here, n) fp32
            st = state[p]
            if st.get("momentum_buffer") is None:
                st["momentum_buffer"] = torch.zeros_like(p, dtype=torch.float32)
            m_local = st["momentum_buffer"].to_local()
            torch.lerp(g_local, m_local, mu, out=m_local)            # M <- mu M + (1-mu) G
            u_local = torch.lerp(g_local, m_local, mu) if group["nesterov"] else m_local
            g_full = _whole(g_local, p) if group["cautious"] else None
            by_shape.setdefault(tuple(p.shape), []).append((p, _whole(u_local, p), g_full))
        compute = NS_DTYPES[group["ns_dtype"]]
        coefficients = ops.resolve_coefficients(group["ns_coefficients"], group["ns_steps"])
        newton_schulz = ops.kernel_or_fallback("newton_schulz", device, [])
        muon_plus = ops.kernel_or_fallback("muon_plus_normalize", device, [torch.float32])
        for shape, items in by_shape.items():
            U = torch.stack([u for _, u, _ in items])                # (b, m, n) fp32
            orthogonalize = functools.partial(_orthogonalize, newton_schulz,
                                              int(group["ns_steps"]), coefficients, eps, compute)
            split = _ns_split(items[0][0], splits)
            orth = (orthogonalize(U) if split is None else
                    sharded_orthogonalize(U, split, orthogonalize, None)[:len(items)])
            if group["muon_plus"]:
                orth = muon_plus(orth, float(group["norm_eps"]))
            if group["cautious"]:
                G = torch.stack([g for _, _, g in items])            # (b, m, n) fp32
                mask = (orth * G) > 0
                orth = orth * mask
                if group["cautious_rescale"]:
                    kept = mask.sum(dim=(-2, -1), keepdim=True)      # (b, 1, 1)
                    orth = orth * ((shape[0] * shape[1]) / (kept + 1))
            scale = adjusted_lr_scale(group["adjust_lr_fn"], shape)
            for (p, _, _), o in zip(items, orth.unbind(0), strict=True):
                p_local = p.to_local()                               # the shard itself
                p_local.mul_(1.0 - lr * wd)           # decoupled decay, as the lean step
                p_local.add_((_my_rows(o, p) * lr).to(p_local.dtype), alpha=-scale)
