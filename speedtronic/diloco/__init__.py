"""DiLoCo over shared storage: workers train H inner steps and upload pseudo-gradients from a
background thread; a master applies an outer (delayed) Nesterov step and publishes new globals.

Entry points: :func:`build_callbacks` (used by the runtime when ``distributed.enabled``),
:class:`Worker`, :class:`Master`, :func:`open_store`, and ``python -m speedtronic.diloco master``.
"""

from __future__ import annotations

from .codec import FormatError, Pointer
from .master import LeaseLost, Master
from .node import Worker
from .outer import OuterOptimizer
from .service import MasterNode, build_callbacks, run_master
from .store import (
    AccessDenied,
    ObjectExists,
    ObjectNotFound,
    PreconditionFailed,
    RetryPolicy,
    Store,
    StoreError,
    StoreUnavailable,
    TransientStoreError,
    open_store,
)

__all__ = [
    "AccessDenied", "FormatError", "LeaseLost", "Master", "MasterNode", "ObjectExists",
    "ObjectNotFound", "OuterOptimizer", "Pointer", "PreconditionFailed", "RetryPolicy", "Store",
    "StoreError", "StoreUnavailable", "TransientStoreError", "Worker", "build_callbacks",
    "open_store", "run_master",
]
