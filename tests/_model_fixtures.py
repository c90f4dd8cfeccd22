"""Tiny model configs and batches shared by tests/models/."""

from __future__ import annotations

import torch

from speedtronic.config import ModelConfig


def tiny(**kw) -> ModelConfig:
    """A validated 2-layer GQA config small enough for a CPU test."""
    base = dict(vocab_size=61, max_seq_len=16, n_layer=2, n_head=4, n_kv_head=2, d_model=32)
    base.update(kw)
    cfg = ModelConfig(**base)
    cfg.validate()
    return cfg


def batch(cfg: ModelConfig, B: int = 3, T: int = 12, seed: int = 0):
    """Seeded random ``(input_ids, labels)``, each ``(B, T)``."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, cfg.vocab_size, (B, T), generator=g)
    y = torch.randint(0, cfg.vocab_size, (B, T), generator=g)
    return x, y
