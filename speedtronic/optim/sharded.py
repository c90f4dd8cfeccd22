"""The Newton-Schulz of a data-parallel Muon step, split across ranks: each rank
orthogonalizes a contiguous 1/W of every shape group's matrices and an all-gather gives every
rank all of them (``Muon(..., process_group=pg)``, also ``HybridOptimizer``).

Why: under data parallelism every rank holds the same averaged gradients, so a replicated
Muon step runs the same Newton-Schulz W times. Newton-Schulz is the step's FLOPs (5 iterations
of three (m x m)-by-(m x n) products per matrix), the rest is elementwise. Splitting whole
matrices, as modded-nanogpt, Moonlight and Dion do, divides those FLOPs by W; the all-gather
moves each orthogonalized matrix once in the NS dtype (fp16 on CUDA: 2 bytes per entry, half of
what the gradient all-reduce moved in fp32). Everything else (momentum, the fp16 guard,
Muon+, cautious masking, the update) still runs on every rank over every matrix, on identical
values, so the parameters stay bitwise equal across ranks and equal to the replicated step
(tests/optim/test_sharded_muon.py checks both on 2 gloo processes).

Balance: a shape group's matrices all cost the same, so equal counts per rank are equal FLOPs;
a group of ``b`` matrices is cut into ``W`` contiguous shares of ``ceil(b / W)`` (the last
fewer, padded with zeros for the gather, never orthogonalized). Which rank takes which share
is rotated per group, by the step's running Newton-Schulz cost per rank (``m^2 n`` per wide
``(m, n)`` matrix): a group whose count does not divide by ``W`` gives its short shares to the
ranks that did the most so far. Without the rotation every odd group's extra matrix landed
on rank 0 (a step of several one-matrix groups ran all of them there); with it the ranks
differ by at most about one matrix per step, not one per group.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

__all__ = ["ShardSpec", "shard_spec", "sharded_orthogonalize"]


class ShardSpec:
    """This rank's place in the process group, read once."""

    def __init__(self, group: Any) -> None:
        import torch.distributed as dist

        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.gather_into_tensor = dist.get_backend(group) == "nccl"
        self.loads = [0.0] * self.world

    def begin_step(self) -> None:
        """Forget the previous step's per-rank costs (every rank calls it at the same point)."""
        self.loads = [0.0] * self.world

    def place(self, count: int, cost: float) -> int:
        """The rotation for a group of ``count`` matrices of ``cost`` each: rank ``r`` takes
        share ``(r - rotation) % W``; chosen to keep the step's busiest rank least busy, the
        same on every rank (it depends only on the groups, which every rank sees alike, and
        on exact small-integer float sums)."""
        per = math.ceil(count / self.world)
        shares = [max(0, min(per, count - i * per)) for i in range(self.world)]

        def loads_after(rot: int) -> tuple[list[float], int]:
            # busiest rank first, then the next busiest, ...: when the busiest cannot get
            # lighter (W = 3, two groups of 5: someone takes 2 + 2) the others still even out
            return sorted((self.loads[r] + cost * shares[(r - rot) % self.world]
                           for r in range(self.world)), reverse=True), rot
        rotation = min(range(self.world), key=loads_after)
        for r in range(self.world):
            self.loads[r] += cost * shares[(r - rotation) % self.world]
        return rotation

    def slots(self, count: int, rotation: int = 0) -> tuple[int, int, int]:
        """(first, stop, per-rank size) of this rank's slots among ``count``."""
        per = math.ceil(count / self.world)
        first = min(count, (self.rank - rotation) % self.world * per)
        return first, min(count, first + per), per


def shard_spec(group: Any) -> ShardSpec | None:
    """A :class:`ShardSpec` when ``group`` spans more than one rank, else None."""
    if group is None:
        return None
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("Muon(process_group=...): torch.distributed is not initialized "
                           "(call torch.distributed.init_process_group first)")
    spec = ShardSpec(group)
    return spec if spec.world > 1 else None


def sharded_orthogonalize(X: Tensor, spec: ShardSpec, orthogonalize: Callable[[Tensor], Tensor],
                          out: Tensor | None) -> Tensor:
    """``orthogonalize`` over ``X (c, m, n)`` with this rank doing its slots only; returns the
    ``(W * per, m, n)`` buffer (``out`` when it fits, to reuse across steps) whose first ``c``
    matrices are all the results, gathered."""
    import torch.distributed as dist

    c, m, n = X.shape
    rotation = spec.place(c, float(min(m, n)) ** 2 * max(m, n))
    first, stop, per = spec.slots(c, rotation)
    if out is None or out.shape != (spec.world * per, *X.shape[1:]) or out.dtype != X.dtype:
        out = torch.empty((spec.world * per, *X.shape[1:]), dtype=X.dtype, device=X.device)
    share = (spec.rank - rotation) % spec.world
    mine = out[share * per:(share + 1) * per]                       # (per, m, n)
    if stop > first:
        mine[:stop - first].copy_(orthogonalize(X[first:stop]))
    mine[stop - first:].zero_()                                     # padding, never read back
    if spec.gather_into_tensor and rotation == 0:
        dist.all_gather_into_tensor(out, mine.clone(), group=spec.group)
    else:  # the list form, rank r's share into its place in the same buffer
        views = out.split(per)
        dist.all_gather([views[(r - rotation) % spec.world] for r in range(spec.world)],
                        mine.clone(), group=spec.group)
    return out
