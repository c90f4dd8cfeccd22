"""Data pipeline: shifts, exact resume, held-out splits, streaming, sharding, user datasets."""

from __future__ import annotations

import random
import string
import sys
import types

import numpy as np
import pytest
import torch
from torch.utils.data import Dataset, IterableDataset

import speedtronic.data as data_mod
from speedtronic.config import ConfigError, load_config
from speedtronic.data import build_data
from speedtronic.data.sampler import WindowIterator
from speedtronic.data.sources import ArrayStore, FileStore, stdlib_corpus

MODEL = {"vocab_size": 256, "max_seq_len": 32, "n_layer": 1, "n_head": 2, "d_model": 16}


def config(data: dict | None = None, **root):
    return load_config({"model": dict(MODEL), "data": {"micro_batch_size": 4, **(data or {})},
                        **root})


def take(it, n):
    return [next(it) for _ in range(n)]


def assert_same(batches_a, batches_b):
    assert len(batches_a) == len(batches_b)
    for (xa, ya), (xb, yb) in zip(batches_a, batches_b, strict=True):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)


def arange_iter(n=1000, T=8, B=5, **kw):
    return WindowIterator(ArrayStore(np.arange(n, dtype=np.int32)), T, B, seed=7, **kw)


def test_labels_are_inputs_shifted_exactly_once():
    for x, y in take(arange_iter(), 50):
        assert x.shape == y.shape == (5, 8) and x.dtype == y.dtype == torch.int64
        assert torch.equal(y, x + 1)  # token ids are positions: y[t] is the token after x[t]
        assert torch.equal(x[:, 1:] - x[:, :-1], torch.ones(5, 7, dtype=torch.int64))
    x, y = next(build_data(config()).train)
    assert x.shape == (4, 32) and torch.equal(x[:, 1:], y[:, :-1])


def test_epoch_covers_every_transition_once_with_moving_boundaries():
    it = arange_iter(n=403, T=8, B=1)
    epochs: dict[int, list[int]] = {}
    while it.epoch < 4:
        epoch = it.epoch
        x, _ = next(it)
        epochs.setdefault(epoch, []).append(int(x[0, 0]))
    offsets = set()
    for starts in epochs.values():
        offset = min(starts)
        offsets.add(offset)
        # stride T, windows of T+1: every pair (t, t+1) inside the epoch's span is a target once
        assert sorted(starts) == list(range(offset, offset + 8 * len(starts), 8))
        assert offset + 8 * len(starts) + 1 > 403 - 8
    assert len(offsets) > 1  # sample boundaries move between epochs


@pytest.mark.parametrize("stop", [1, 37, 80, 120])
def test_exact_resume_across_epochs(stop):
    reference = take(arange_iter(), 160)  # ~1.3 epochs of 124 windows / 5 per batch
    it = arange_iter()
    take(it, stop)
    state = it.state_dict()
    resumed = arange_iter()
    resumed.load_state_dict(state)
    assert_same(take(resumed, 160 - stop), reference[stop:])


def test_exact_resume_of_default_corpus_through_build_data():
    cfg = config()
    first = build_data(cfg)
    take(first.train, 5)
    state = first.train.state_dict()
    expected = take(first.train, 5)
    again = build_data(cfg)
    again.train.load_state_dict(state)
    assert_same(take(again.train, 5), expected)


def test_rank_shards_are_disjoint_and_cover_the_epoch():
    seen = []
    for rank in range(3):
        it = arange_iter(n=1000, T=8, B=2, rank=rank, world=3)
        starts = []
        while it.epoch == 0:
            x, _ = next(it)
            starts.extend(x[:, 0].tolist())
        seen.append(set(starts[: len(starts) - 2]))  # last batch may spill into epoch 1
    assert not (seen[0] & seen[1] or seen[0] & seen[2] or seen[1] & seen[2])
    assert len(seen[0] | seen[1] | seen[2]) >= 124 - 6


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
    real_read = FileStore.read

    def spy(self, a, b):
        reads.append(b - a)
        return real_read(self, a, b)

    monkeypatch.setattr(FileStore, "read", spy)
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


class Sequences(Dataset):
    """Items are raw token sequences of length T+1 whose ids encode their index."""

    def __init__(self, n: int, T: int) -> None:
        self.n, self.T = n, T

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.arange(self.T + 1) + 1000 * i


class Pairs(IterableDataset):
    def __init__(self, n: int, T: int) -> None:
        self.n, self.T = n, T

    def __iter__(self):
        for i in range(self.n):
            x = torch.full((self.T,), i)
            yield x, x + 1


def test_user_map_dataset_shift_resume_and_holdout():
    ds = Sequences(50, 32)
    cfg = config({"dataset": ds})
    bundle = build_data(cfg)
    reference = take(bundle.train, 30)  # crosses epochs (45 train items / 4 per batch)
    for x, y in reference:
        assert torch.equal(y, x + 1)
    held = {int(x[i, 0]) // 1000 for x, _ in bundle.eval_batches(2) for i in range(4)}
    trained = {int(x[i, 0]) // 1000 for x, _ in reference for i in range(4)}
    assert held and not held & trained
    again = build_data(cfg)
    take(again.train, 13)
    state = again.train.state_dict()
    resumed = build_data(cfg)
    resumed.train.load_state_dict(state)
    assert_same(take(resumed.train, 17), reference[13:])


def test_user_iterable_pairs_from_import_string(monkeypatch):
    module = types.ModuleType("speedtronic_test_datasets")
    module.make = lambda cfg: (Pairs(23, 32), Pairs(8, 32))
    monkeypatch.setitem(sys.modules, "speedtronic_test_datasets", module)
    cfg = config({"dataset": "speedtronic_test_datasets:make"})
    bundle = build_data(cfg)
    reference = take(bundle.train, 12)  # 5 full batches per pass: crosses passes
    assert [int(x[0, 0]) for x, _ in reference[:6]] == [0, 4, 8, 12, 16, 0]
    assert torch.equal(reference[0][1], reference[0][0] + 1)  # pairs are used unshifted
    it = build_data(cfg).train
    take(it, 7)
    resumed = build_data(cfg).train
    resumed.load_state_dict(it.state_dict())
    assert_same(take(resumed, 5), reference[7:])
    assert [int(x[0, 0]) for x, _ in bundle.eval_batches(2)] == [0, 4]
    with pytest.raises(ConfigError, match="package.module:factory"):
        build_data(config({"dataset": "no_colon_here"}))
