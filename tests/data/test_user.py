"""User datasets (data/user.py): map and iterable datasets, shifts, exact resume, holdout."""

from __future__ import annotations

import sys
import types

import pytest
import torch
from _data_fixtures import assert_same, config, take
from torch.utils.data import Dataset, IterableDataset

from speedtronic.config import ConfigError
from speedtronic.data import build_data


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
    reference = take(bundle.train, 30)  # crosses epochs (47 train items / 4 per batch)
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


def test_the_holdout_does_not_depend_on_the_micro_batch_size():
    # The same samples in the same order for micro 4 x 4 and micro 16 at target 16.
    ds = Sequences(256, 32)
    small = build_data(config({"dataset": ds, "micro_batch_size": 4, "target_batch_size": 16}))
    big = build_data(config({"dataset": ds, "micro_batch_size": 16, "target_batch_size": 16}))
    ids = [int(x[i, 0]) // 1000 for x, _ in take(small.train, 8) for i in range(4)]
    assert ids == [int(x[i, 0]) // 1000 for x, _ in take(big.train, 2) for i in range(16)]


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


def test_a_factory_that_cannot_take_the_config_is_a_config_error(monkeypatch, tmp_path, capsys):
    module = types.ModuleType("speedtronic_test_factories")
    module.no_args = lambda: Sequences(50, 32)
    module.two_args = lambda cfg, split: Sequences(50, 32)

    def buggy(cfg):  # the right signature, a bug inside: the user's own TypeError stays as is
        return len(None)

    module.buggy = buggy
    monkeypatch.setitem(sys.modules, "speedtronic_test_factories", module)
    for spec in ("speedtronic_test_factories:no_args", "speedtronic_test_factories:two_args",
                 "os:getcwd"):
        with pytest.raises(ConfigError, match=r"data.dataset: .* cannot be called as "
                                              r"factory\(cfg\)") as info:
            build_data(config({"dataset": spec}))
        assert spec in str(info.value) and "one positional argument" in str(info.value)
    with pytest.raises(TypeError, match="NoneType") as info:
        build_data(config({"dataset": "speedtronic_test_factories:buggy"}))
    assert not isinstance(info.value, ConfigError)

    from speedtronic.cli import main

    run = tmp_path / "run.yaml"
    run.write_text(f"model: {{vocab_size: 256, max_seq_len: 32, n_layer: 1, n_head: 2, "
                   f"d_model: 16}}\nrun: {{output_dir: {tmp_path / 'runs'}, max_steps: 1, "
                   "device: cpu}\n")
    assert main(["train", "--config", str(run), "--set", "data.dataset=os:getcwd"]) == 2
    err = capsys.readouterr().err.strip()
    assert "data.dataset: 'os:getcwd'" in err and len(err.splitlines()) == 1, err


@pytest.mark.parametrize("kind", ["map", "iterable"])
def test_a_resume_with_another_micro_batch_continues_at_the_same_item(kind):
    """The position is kept in items: resumed with micro_batch_size 2 after 3 batches of 4, the
    next items are items 12-15 of the epoch (counting batches, 6-9 again were trained on)."""
    from speedtronic.data.user import UserIterator

    def items(batches):
        return [int(v) // 1000 for x, _ in batches for v in x[:, 0]]

    def make(batch_size):
        ds = Sequences(40, 8) if kind == "map" else _Numbered(40, 8)
        return UserIterator(ds, batch_size, seed=3, rank=0, world=1, shuffle=kind == "map",
                            num_workers=0, pin_memory=False)

    straight = make(4)
    order = items([next(straight) for _ in range(4)])   # items of batches 1-4
    first = make(4)
    [next(first) for _ in range(3)]
    resumed = make(2)
    resumed.load_state_dict(first.state_dict())
    assert items([next(resumed) for _ in range(2)]) == order[12:16]


class _Numbered(IterableDataset):
    """Items 0..n-1 in order, as Sequences numbers them."""

    def __init__(self, n: int, T: int) -> None:
        self.n, self.T = n, T

    def __iter__(self):
        for i in range(self.n):
            yield torch.arange(self.T + 1) + 1000 * i
