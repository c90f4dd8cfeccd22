"""Which rank owns which Muon matrix under ``data_parallel.reduce_scatter_muon``.

Matrices of one packed shape (tall ones transposed beside the wide ones) are cut into buckets in
the order backward finishes them; each bucket into W contiguous shares of whole matrices; which
rank takes which share rotates by the running Newton-Schulz cost (``m^2 n`` per matrix, through
:class:`~speedtronic.optim.sharded.ShardSpec`), so the ranks' work differs by at most about one
matrix. :class:`_Bucket` records the outcome, and where each matrix sits in the bucket's buffer;
the collectives that move gradients and parameters through it are in
:mod:`speedtronic.distributed.muon_owners`. Nothing here communicates, except the group queries
that :class:`ShardSpec` makes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from ..optim.sharded import ShardSpec


@dataclass
class _Bucket:
    """Matrices of one packed shape whose gradients travel in one reduce-scatter."""

    params: list[Tensor]        # by owning rank: rank r's fill slots [r * per, (r + 1) * per)
    transposed: list[bool]      # packed as p.mT (a tall matrix beside the wide ones)
    owner: list[int]            # rank that owns each param
    per: int                    # slots per rank
    packed: tuple[int, ...]     # one slot's shape
    rotation: int               # rank r holds share (r - rotation) % W
    buffer: Tensor | None = None  # (W * per, *packed) fp32: grads / W, then the params
    share: Tensor | None = None   # (per, *packed): this rank's averaged gradients
    ready: int = 0
    work: Any = None
    mine: list[int] = field(default_factory=list)  # indices into params that this rank owns

    def view(self, t: Tensor, i: int) -> Tensor:
        """Slot ``t`` seen in param ``i``'s own shape."""
        return t.mT if self.transposed[i] else t.view(self.params[i].shape)


def _packed_shape(p: Tensor) -> tuple[tuple[int, ...], bool]:
    """(slot shape, transposed?): 2-D tall matrices go in as their transpose."""
    if p.dim() == 2 and p.shape[0] > p.shape[1]:
        return (p.shape[1], p.shape[0]), True
    return tuple(p.shape), False


def _cost(shape: tuple[int, ...]) -> float:
    m = shape[0]
    n = math.prod(shape[1:]) if len(shape) > 1 else 1
    return float(min(m, n)) ** 2 * max(m, n)


class OwnershipPlanner:
    """The planning half of :class:`~speedtronic.distributed.muon_owners.OwnerShardedHybrid`,
    mixed into it: reads its ``comm``, ``world`` and ``rank``."""

    comm: Any
    world: int
    rank: int

    # ---- planning ------------------------------------------------------------------------
    def _plan(self, muon: list[Tensor], cap_bytes: int) -> list[_Bucket]:
        """Buckets in the order backward finishes their gradients (the reverse of the
        parameters' order), one packed shape each, at most ``cap_bytes`` (at least W
        matrices), shares rotated by the running cost."""
        spec = ShardSpec(self.comm)
        runs: dict[tuple, list[tuple[Tensor, bool]]] = {}
        order: list[tuple] = []
        for p in reversed(muon):
            packed, t = _packed_shape(p)
            key = (packed, p.dtype, p.device)
            if key not in runs:
                runs[key], _ = [], order.append(key)
            runs[key].append((p, t))
        buckets = []
        for key in order:
            items = runs[key]
            packed = key[0]
            per_matrix = math.prod(packed) * torch.empty((), dtype=key[1]).element_size()
            size = max(self.world, cap_bytes // max(1, per_matrix) // self.world * self.world)
            for start in range(0, len(items), size):
                chunk = items[start:start + size]
                rotation = spec.place(len(chunk), _cost(packed))
                per = math.ceil(len(chunk) / self.world)
                params, transposed, owner = [], [], []
                # share s = matrices [s * per, (s + 1) * per) of the chunk; rank r takes share
                # (r - rotation) % W and packs it at slot r * per (the collective's layout)
                for r in range(self.world):
                    s = (r - rotation) % self.world
                    for p, t in chunk[s * per:(s + 1) * per]:
                        params.append(p)
                        transposed.append(t)
                        owner.append(r)
                b = _Bucket(params, transposed, owner, per, packed, rotation)
                b.mine = [i for i, r in enumerate(owner) if r == self.rank]
                buckets.append(b)
        # Launch order = when backward is expected to finish a bucket (its last member in the
        # reversed parameter order), so the shapes' buckets interleave as their layers finish.
        # Buckets start strictly in this order on every rank: a rank whose hook for some
        # parameter never fires (unused there) then delays the later buckets instead of
        # issuing its collectives in another order than its peers.
        due = {id(p): i for i, p in enumerate(reversed(muon))}
        buckets.sort(key=lambda b: max(due[id(p)] for p in b.params))
        return buckets

    def _slots(self, b: _Bucket) -> list[int]:
        """Slot of each param of ``b`` in its buffer (rank r's share starts at r * per)."""
        out, seen = [], [0] * self.world
        for r in b.owner:
            out.append(r * b.per + seen[r])
            seen[r] += 1
        return out
