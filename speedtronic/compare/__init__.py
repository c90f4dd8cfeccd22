"""``speedtronic compare``: judge optimizers by quality, not only by speed.

Trains one base config with several optimizer variants (presets ``adamw``, ``muon``,
``muon_plus``, ``cautious_adamw``, ``cautious_muon`` or custom overrides) from the same initial
weights, on the same batches and seeds, and reports losses, time to the baseline's loss,
throughput, optimizer step time, memory and the spectra of the trained weight matrices.

Importing this package is cheap (no torch): the CLI builds its parser from
:mod:`speedtronic.compare.command`; :func:`run_compare` loads the heavy parts on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

from .variants import PRESETS, Variant, parse_variant, parse_variants

__all__ = ["PRESETS", "Variant", "parse_variant", "parse_variants", "run_compare",
           "CompareResult"]


def __getattr__(name: str) -> Any:
    if name in ("run_compare", "CompareResult", "DEFAULT_LR_FACTORS"):
        return getattr(importlib.import_module(".api", __name__), name)
    raise AttributeError(f"module 'speedtronic.compare' has no attribute {name!r}")
