"""Speedtronic optimizers: Muon (drop-in for ``torch.optim.Muon``), AdamW, Muon+, cautious, and
hybrid routing into one optimizer object.

* :class:`Muon` - batched Newton-Schulz Muon with ``muon_plus`` / ``cautious`` options.
* :class:`AdamW` - AdamW with an optional cautious mask.
* :func:`route_parameters` - which tensors go to Muon and which to AdamW;
  :func:`describe_routing` prints it as a table.
* :func:`build_optimizer` - ``HybridOptimizer`` for a model from ``cfg.optimizer``.
"""

from .adamw import AdamW
from .build import HybridOptimizer, build_optimizer
from .muon import Muon
from .routing import (
    ROLE_ATTRIBUTE,
    SPLIT_ATTRIBUTE,
    ParameterRoutes,
    describe_routing,
    route_parameters,
)

__all__ = ["AdamW", "HybridOptimizer", "Muon", "ParameterRoutes", "ROLE_ATTRIBUTE",
           "SPLIT_ATTRIBUTE", "build_optimizer", "describe_routing", "route_parameters"]
