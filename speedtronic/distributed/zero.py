"""ZeRO-1 for ``torchrun speedtronic train``: each rank keeps the optimizer state of a share of
the parameters, steps only those, and the updated parameters are broadcast to every rank
(``data_parallel.zero1: true``). Built on torch's
:class:`~torch.distributed.optim.ZeroRedundancyOptimizer`, with our :class:`HybridOptimizer` as
each rank's local optimizer: nothing here partitions or communicates by itself.

What it buys and what it costs (W ranks, P parameters):

* **memory**: the optimizer state per rank drops from ``P`` fp32 values for Muon's momentum and
  ``2 P`` for Adam's moments to about ``1/W`` of that (torch's partition: within each param
  group, largest tensor first, to the rank holding the fewest elements so far), and the lean
  Muon step's banks and workspaces shrink the same way;
* **Newton-Schulz work**: a rank orthogonalizes only the matrices it owns, so the split that
  ``data_parallel.shard_muon`` makes is implied (it is not applied on top);
* **communication**: one broadcast of every parameter per step from its owner, in the
  parameter dtype, on top of DDP's gradient all-reduce (``shard_muon`` instead all-gathers only
  the Muon matrices, in the Newton-Schulz dtype). A ring all-reduce sends ``2 (W-1)/W P`` values
  per rank, so ZeRO-1 adds about half of DDP's traffic: use it when the state does not fit, not
  for speed.
* **checkpoints**: the state is gathered to rank 0 when a checkpoint is made (a collective every
  rank joins: the trainer builds its state on every rank at the same step) and written in the
  same format as without ZeRO-1, so a run can resume with ``zero1`` on or off; on resume each
  rank keeps its share.

Not combined with ``optimizer.cuda_graph`` (the broadcast is outside the captured step) or
torchft replica groups (a healing peer's state would be gathered by one rank, outside the
lock-step of the others: refused).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch.distributed.optim import ZeroRedundancyOptimizer

from ..config import ConfigError, SpeedtronicConfig

__all__ = ["ZeroHybridOptimizer", "check_zero1", "zero1_optimizer"]

logger = logging.getLogger("speedtronic.distributed")


def check_zero1(cfg: SpeedtronicConfig) -> None:
    """Refuse what ZeRO-1 does not combine with, with the reason."""
    if not cfg.data_parallel.zero1:
        return
    if cfg.optimizer.cuda_graph != "off":
        raise ConfigError(
            f"data_parallel.zero1: true with optimizer.cuda_graph: {cfg.optimizer.cuda_graph}: "
            "the parameter broadcast after each rank's step is not part of a captured graph; "
            "set optimizer.cuda_graph: off or data_parallel.zero1: false")


class ZeroHybridOptimizer(ZeroRedundancyOptimizer):
    """torch's ZeRO-1 wrapper with the methods the engine calls on its optimizer.

    ``state_dict()`` is a collective here (it consolidates onto rank 0 first) and returns the
    full state on rank 0, ``None`` elsewhere; ``reset_state()`` clears this rank's share (a
    DiLoCo outer step resets every rank's inner optimizer)."""

    def state_dict(self) -> dict[str, Any] | None:  # type: ignore[override]
        self.consolidate_state_dict(to=0)
        if self.rank != 0:
            return None
        state = super().state_dict()
        self._all_state_dicts = []  # the gathered copy would otherwise stay on rank 0's host
        return state

    def reset_state(self) -> None:
        """Clear the inner state of this rank's share (keeps hyperparameters and the lr)."""
        self.optim.state.clear()

    @property
    def local(self) -> Any:
        """This rank's :class:`HybridOptimizer` (its share of the parameters)."""
        return self.optim


def zero1_optimizer(optimizer: torch.optim.Optimizer, group: Any = None) -> ZeroHybridOptimizer:
    """Re-partition the param groups of a built :class:`HybridOptimizer` across the ranks of
    ``group`` (default: the world) as ZeRO-1; logs what this rank keeps."""
    from ..optim import HybridOptimizer

    if not isinstance(optimizer, HybridOptimizer):
        raise TypeError(f"zero1_optimizer takes a HybridOptimizer, got {type(optimizer).__name__}")
    if optimizer.state:
        raise ValueError("zero1_optimizer: build it before the first step (the optimizer "
                         "already holds state)")
    groups = [dict(g, params=list(g["params"])) for g in optimizer.param_groups]
    zero = ZeroHybridOptimizer(groups, optimizer_class=HybridOptimizer, process_group=group)
    mine = [p for g in zero.optim.param_groups for p in g["params"]]
    total = sum(p.numel() for g in groups for p in g["params"])
    logger.info("data parallel: ZeRO-1: rank %d of %d keeps optimizer state for %d of %d "
                "tensors (%d of %d elements)", zero.rank, zero.world_size, len(mine),
                sum(len(g["params"]) for g in groups), sum(p.numel() for p in mine), total)
    return zero
