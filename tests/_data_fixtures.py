"""Config and iterator helpers shared by tests/data/."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from speedtronic.config import SpeedtronicConfig, load_config
from speedtronic.data.sampler import WindowIterator
from speedtronic.data.sources import ArrayStore

MODEL = {"vocab_size": 256, "max_seq_len": 32, "n_layer": 1, "n_head": 2, "d_model": 16}


def config(data: dict | None = None, **root) -> SpeedtronicConfig:
    """A byte-level tiny-model config with ``data`` merged over micro batch 4."""
    return load_config({"model": dict(MODEL), "data": {"micro_batch_size": 4, **(data or {})},
                        **root})


def take(it, n):
    return [next(it) for _ in range(n)]


def assert_same(batches_a, batches_b):
    assert len(batches_a) == len(batches_b)
    for (xa, ya), (xb, yb) in zip(batches_a, batches_b, strict=True):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)


def arange_iter(n=1000, T=8, B=5, **kw):
    """Windows over the ids 0..n-1, so every token's value is its position."""
    return WindowIterator(ArrayStore(np.arange(n, dtype=np.int32)), T, B, seed=7, **kw)


def byte_level_bpe(texts: list[str], vocab_size: int, path: Path) -> Path:
    """Train a byte-level BPE with an ``<|endoftext|>`` token on ``texts`` (offline) and save it
    as ``path``; returns ``path``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    tok.save(str(path))
    return path
