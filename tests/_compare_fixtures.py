"""The tiny base config shared by tests/compare/ (fixtures are in tests/compare/conftest.py)."""

from __future__ import annotations

TINY = {
    "run": {"seed": 3, "eval_batches": 2},
    "model": {"d_model": 32, "n_layer": 1, "n_head": 2, "max_seq_len": 32},
    "data": {"micro_batch_size": 4, "stdlib_max_bytes": 200_000},
    "scheduler": {"warmup_steps": 1},
    "logging": {"every_steps": 1, "progress_bar": False},
    "shape_validation": {"enabled": False},
}
FAST_ADAMW = "fast:optimizer.lr=3e-3"  # an AdamW variant that clearly beats the 3e-4 default
