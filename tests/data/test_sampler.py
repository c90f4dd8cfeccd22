"""The window sampler (data/sampler.py): the one shift, epoch coverage, exact resume, disjoint rank
shards.
"""

from __future__ import annotations

import pytest
import torch
from _data_fixtures import arange_iter, assert_same, config, take

from speedtronic.data import build_data


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
