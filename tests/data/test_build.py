"""build_data (data/build.py): the stdlib corpus split, determinism, streamed text files, synthetic
data, per-node seeds, vocab checks.
"""

from __future__ import annotations

import random
import string

import pytest
import torch
from _data_fixtures import MODEL, assert_same, config, take

import speedtronic.data.build as data_mod
from speedtronic.config import ConfigError, load_config
from speedtronic.data import build_data
from speedtronic.data.sources import TextFileStore, stdlib_corpus


def test_stdlib_eval_split_is_disjoint_by_file_and_deterministic():
    corpus = stdlib_corpus(2_000_000, 0.1)
    assert corpus.eval_paths and corpus.train_paths
    assert not set(corpus.eval_paths) & set(corpus.train_paths)
    assert all(p.endswith(".py") and "site-packages" not in p for p in corpus.train_paths)
    assert corpus.train.size + corpus.eval.size <= 2_000_000
    # The split depends on file names only: a larger cap keeps every earlier assignment.
    bigger = stdlib_corpus(3_000_000, 0.1)
    assert set(corpus.eval_paths) <= set(bigger.eval_paths)
    assert set(corpus.train_paths) <= set(bigger.train_paths)


def test_builds_are_deterministic_and_eval_batches_are_stable():
    cfg = config({"stdlib_max_bytes": 1_000_000})
    a, b = build_data(cfg), build_data(cfg)
    assert_same(take(a.train, 3), take(b.train, 3))
    first = a.eval_batches(3)
    take(a.train, 10)  # training progress must not move the eval set
    assert_same(first, a.eval_batches(3))
    assert_same(first, b.eval_batches(3))
    other_seed = build_data(config({"stdlib_max_bytes": 1_000_000, "seed": 99}))
    assert not torch.equal(next(other_seed.train)[0], take(build_data(cfg).train, 1)[0][0])
    for x, y in first:
        assert x.shape == (4, 32) and torch.equal(x[:, 1:], y[:, :-1])


def test_text_file_streams_in_chunks_across_boundaries(tmp_path, monkeypatch):
    rng = random.Random(0)
    text = "".join(rng.choice(string.ascii_letters + " \n") for _ in range(6000))
    path = tmp_path / "corpus.txt"
    path.write_text(text, encoding="utf-8")
    raw = text.encode()
    monkeypatch.setattr(data_mod, "TEXT_CHUNK_BYTES", 64)  # 8 windows of T=8 per chunk
    reads: list[int] = []
    real_read = TextFileStore.read

    def spy(self, a, b):
        reads.append(b - a)
        return real_read(self, a, b)

    monkeypatch.setattr(TextFileStore, "read", spy)
    cfg = config({"text_path": str(path), "block_size": 8, "eval_fraction": 0.1})
    bundle = build_data(cfg)
    split = int(len(raw) * 0.9)
    starts = []
    while bundle.train.epoch == 0:
        x, y = next(bundle.train)
        for row_x, row_y in zip(x.tolist(), y.tolist(), strict=True):
            window = bytes(row_x + row_y[-1:])
            start = raw.find(window)
            assert 0 <= start and start + 9 <= split  # a real train window of the file
            starts.append(start)
    assert max(reads) <= 64 + 1  # one chunk (+1 token carried into the next) at a time
    assert any(s // 64 != (s + 8) // 64 for s in starts)  # windows span chunk boundaries
    assert len(set(starts)) >= (split - 8) // 8 - 1
    for x, y in bundle.eval_batches(2):
        for row_x, row_y in zip(x.tolist(), y.tolist(), strict=True):
            assert raw.find(bytes(row_x + row_y[-1:])) >= split  # eval is the held-out tail


def test_synthetic_differs_by_rank_but_eval_does_not():
    cfg = config({"synthetic": True, "num_tokens": 20_000}, seed=3)
    r0, r1 = build_data(cfg, rank=0, world=2), build_data(cfg, rank=1, world=2)
    x0, x1 = next(r0.train)[0], next(r1.train)[0]
    assert not torch.equal(x0, x1)
    assert int(x0.max()) < 256
    assert_same(r0.eval_batches(2), r1.eval_batches(2))
    with pytest.raises(ValueError, match="rank"):
        build_data(cfg, rank=2, world=2)


def test_diloco_nodes_without_rank_get_different_orders_by_node_id():
    def first(node):
        cfg = config({"stdlib_max_bytes": 500_000}, distributed={
            "enabled": True, "store": "file:///tmp/unused", "node_id": node})
        return next(build_data(cfg).train)[0]

    assert torch.equal(first("w0"), first("w0"))  # stable across restarts
    assert not torch.equal(first("w0"), first("w1"))


def test_byte_data_needs_vocab_256():
    cfg = load_config({"model": {**MODEL, "vocab_size": 100}})
    with pytest.raises(ConfigError, match="model.vocab_size"):
        build_data(cfg)
