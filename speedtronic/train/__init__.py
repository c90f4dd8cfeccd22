"""The training loop and its parts: one training run on one process.

* :mod:`.runtime` turns a validated config into a run (``train_from_config``): data, model,
  optimizer, callbacks, then the :class:`~speedtronic.train.trainer.Trainer`; :mod:`.run_parts`
  builds those parts, :mod:`.runtime` the run directory around them.
* :mod:`.trainer` runs the steps; :mod:`.accumulation` (token-weighted micro-batches),
  :mod:`.precision` (device, dtype and compile decisions), :mod:`.checkpoint` (atomic, resumable
  saves), :mod:`.metrics`, :mod:`.mfu`, :mod:`.plot`, :mod:`.host_memory` (glibc malloc tuning)
  and :mod:`.shapes` (start-up shape-alignment check) are its parts.
* Reliability: :mod:`.nonfinite` (the NaN/inf guard), :mod:`.preemption` (signals -> save and
  exit), :mod:`.run_lock` (one run per directory), :mod:`.resume` (what a resume honours),
  :mod:`.preflight` (train's checks before any device, also run by ``validate``).
* :mod:`.run_model`: a run's model from its directory (``sample``, ``export``) and
  ``model.init_from``.

May import every layer below it: config, kernels, models, data, optim, ooo, diloco. Only
``compare`` and ``cli`` import it.
"""

from __future__ import annotations

import importlib
from typing import Any

#: The names most users want, served lazily (importing the package alone loads no torch).
_EXPORTS = {
    "Trainer": ".trainer", "TrainerCallback": ".trainer", "TrainResult": ".trainer",
    "train_from_config": ".runtime", "build_trainer": ".runtime",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
