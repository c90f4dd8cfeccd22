"""The window sampler (data/sampler.py): the one shift, epoch coverage, exact resume, disjoint rank
shards.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from _data_fixtures import arange_iter, assert_same, config, take

from speedtronic.data import build_data
from speedtronic.errors import SpeedtronicError


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


@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("T", [1, 4, 32])
def test_too_few_train_tokens_states_the_real_minimum(T, world, shuffle):
    def accepts(n: int) -> bool:
        try:
            arange_iter(n=n, T=T, B=1, world=world, shuffle=shuffle)
        except SpeedtronicError:
            return False
        return True

    least = next(n for n in range(1, 10 * T + 10) if accepts(n))
    assert all(accepts(n) for n in range(least, least + 3 * T))  # and every longer store
    with pytest.raises(SpeedtronicError) as info:
        arange_iter(n=least - 1, T=T, B=1, world=world, shuffle=shuffle, name="data.x 'f.bin'")
    message = str(info.value)
    assert message.startswith("data.x 'f.bin': only")
    assert int(re.search(r"need at least (\d+) train tokens", message).group(1)) == least


def test_short_token_files_name_the_file_key_and_the_right_fix(tmp_path):
    np.arange(32, dtype=np.uint16).tofile(tmp_path / "train.bin")
    np.arange(33, dtype=np.uint16).tofile(tmp_path / "train33.bin")
    np.arange(20, dtype=np.uint16).tofile(tmp_path / "val.bin")
    np.arange(600, dtype=np.uint16).tofile(tmp_path / "val600.bin")
    with pytest.raises(SpeedtronicError) as info:
        build_data(config({"tokens_path": str(tmp_path / "train.bin"),
                           "eval_tokens_path": str(tmp_path / "val600.bin")}))
    assert (f"data.tokens_path {str(tmp_path / 'train.bin')!r}: only 32 train tokens" in
            str(info.value)) and "need at least 33 train tokens" in str(info.value)
    build_data(config({"tokens_path": str(tmp_path / "train33.bin"),
                       "eval_tokens_path": str(tmp_path / "val600.bin")}))  # 33 is enough
    with pytest.raises(SpeedtronicError) as info:
        build_data(config({"tokens_path": str(tmp_path / "train33.bin"),
                           "eval_tokens_path": str(tmp_path / "val.bin")}))
    message = str(info.value)
    assert message.startswith(f"data.eval_tokens_path {str(tmp_path / 'val.bin')!r}: only 20 "
                              "eval tokens, fewer than block_size+1=33")
    assert "use a longer data.eval_tokens_path" in message and "eval_fraction" not in message


def test_eval_files_inside_the_training_folder_are_never_trained_on(tmp_path):
    """A folder of fineweb_train_*.bin and fineweb_val_*.bin as tokens_path and the val files
    as eval_tokens_path: the val tokens were trained on too (23,000 train / 3,000 eval)."""
    folder = tmp_path / "fw"
    folder.mkdir()
    (np.arange(1000) % 7).astype(np.uint16).tofile(folder / "fineweb_train_000001.bin")
    np.full(600, 9, dtype=np.uint16).tofile(folder / "fineweb_val_000000.bin")
    data = build_data(config({"tokens_path": str(folder),
                              "eval_tokens_path": str(folder / "fineweb_val_*.bin")}))
    assert "1,000 train / 600 eval tokens" in data.description
    seen = torch.cat([x.flatten() for x, _ in take(data.train, 30)])
    assert not (seen == 9).any()  # no val token in a training batch
    with pytest.raises(SpeedtronicError, match="every file it names is also in "
                                               "data.eval_tokens_path"):
        build_data(config({"tokens_path": str(folder / "fineweb_val_000000.bin"),
                           "eval_tokens_path": str(folder / "fineweb_val_*.bin")}))


def _resume_warnings(saved_tokens: np.ndarray, resumed_tokens: np.ndarray, caplog,
                     drop_keys: tuple[str, ...] = ()) -> list[str]:
    """Warnings of resuming, onto ``resumed_tokens``, a position saved over ``saved_tokens``."""
    from speedtronic.data.sampler import WindowIterator
    from speedtronic.data.sources import ArrayStore

    it = WindowIterator(ArrayStore(saved_tokens), 8, 4, seed=3)
    take(it, 3)
    state = it.state_dict()
    for key in drop_keys:
        del state["meta"][key]
    caplog.clear()
    with caplog.at_level("WARNING", logger="speedtronic.data"):
        WindowIterator(ArrayStore(resumed_tokens), 8, 4, seed=3).load_state_dict(state)
    return [r.getMessage() for r in caplog.records if "resuming a position" in r.getMessage()]


def test_resume_onto_other_tokens_of_the_same_length_is_warned_about(caplog):
    tokens = np.arange(4000, dtype=np.int32) % 251
    assert _resume_warnings(tokens, tokens.copy(), caplog) == []
    edited = tokens[::-1].copy()  # re-tokenized or edited data: same count, other ids
    (warning,) = _resume_warnings(tokens, edited, caplog)
    assert "tokens_sample" in warning and "tokens:" not in warning  # the count is unchanged
    # the same ids stored in another dtype (uint16 shards vs int32) are the same data
    assert _resume_warnings(tokens, tokens.astype(np.uint16), caplog) == []


def test_a_position_saved_before_the_tokens_sample_resumes_without_a_warning(caplog):
    tokens = np.arange(4000, dtype=np.int32) % 251
    assert _resume_warnings(tokens, tokens, caplog, drop_keys=("tokens_sample",)) == []
    (warning,) = _resume_warnings(tokens, tokens[:-200], caplog, drop_keys=("tokens_sample",))
    assert "tokens: 4000 -> 3800" in warning
