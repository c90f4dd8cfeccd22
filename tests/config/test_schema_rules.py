"""Schema rules added for reliability: DiLoCo run names, seed range, catchable signals."""

from __future__ import annotations

import socket

import pytest

from speedtronic.config import ConfigError, load_config


def test_diloco_runs_are_named_by_node_id_so_workers_never_share_a_directory():
    worker = {"distributed": {"enabled": True, "store": "file:///tmp/s", "node_id": "w7"}}
    assert load_config(worker).run.name == "diloco-worker-w7"
    named = {**worker, "run": {"name": "exp-{node_id}"}}
    assert load_config(named).run.name == "exp-w7"
    anonymous = {"distributed": {"enabled": True, "store": "file:///tmp/s"}}
    assert socket.gethostname()[:10].replace("_", "-")[:3] in load_config(anonymous).run.name
    assert load_config({"run": {"name": "plain"}}).run.name == "plain"
    # a bad id is named as such, not as the run name built from it
    with pytest.raises(ConfigError, match="distributed.node_id: must be 1-64"):
        load_config({"distributed": {**worker["distributed"], "node_id": "w/1"}})


@pytest.mark.parametrize("seed", [2**64, -2**63 - 1])
def test_a_seed_torch_cannot_take_is_refused(seed):
    with pytest.raises(ConfigError, match="run.seed"):
        load_config({"run": {"seed": seed}})


def test_preemption_signals_must_be_catchable():
    assert load_config({"train": {"preemption_signals": []}}).train.preemption_signals == []
    for bad in ("SIGKILL", "SIGNOPE", "TERM"):
        with pytest.raises(ConfigError, match="train.preemption_signals"):
            load_config({"train": {"preemption_signals": [bad]}})


def test_byte_text_is_one_file_and_takes_a_home_path(tmp_path, monkeypatch):
    """A folder said "file not found" for a path that exists; "~/x.txt" was not expanded."""
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "x.txt").write_text("some text\n" * 100)
    assert load_config({"data": {"text_path": "~/x.txt"}}).data.text_path == "~/x.txt"
    for spec in (str(tmp_path), str(tmp_path / "*.txt")):
        with pytest.raises(ConfigError, match="is a folder or a glob; read as bytes"):
            load_config({"data": {"text_path": spec}})


@pytest.mark.parametrize("key, value", [
    ("run.num_threads", 100000),  # crashed inside torch.set_num_threads (segfault)
    ("run.num_threads", 2**70),   # "Overflow when unpacking long long", no key named
    ("optimizer.muon_ns_steps", 100),  # refused by the optimizer only, without the key
])
def test_values_that_crashed_at_run_time_are_refused_with_their_key(key, value):
    section, leaf = key.split(".")
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config({section: {leaf: value}})
    assert getattr(getattr(load_config({section: {leaf: 8}}), section), leaf) == 8


def test_more_eval_batches_than_the_eval_split_holds_is_refused_when_the_data_is_built():
    """run.eval_batches=1e9 ran the machine out of memory (killed, no message) at the first
    eval; more windows than the split has distinct ones only repeats them."""
    from speedtronic.data import build_data

    cfg = load_config({"data": {"synthetic": True, "num_tokens": 20_000, "block_size": 32,
                                "micro_batch_size": 4}, "run": {"eval_batches": 10**9}})
    with pytest.raises(ConfigError, match=r"run\.eval_batches=1000000000: .* use "
                                          r"run\.eval_batches <= \d+"):
        build_data(cfg, rank=0, world=1)
    cfg.run.eval_batches = 2
    assert len(build_data(cfg, rank=0, world=1).eval_batches(2)) == 2
    # a small held-out split read several times over (the synthetic set's) still builds
    small = load_config({"model": {"max_seq_len": 512},
                         "data": {"synthetic": True, "num_tokens": 10_000, "block_size": 512,
                                  "micro_batch_size": 1}})
    assert len(build_data(small, rank=0, world=1).eval_batches(small.run.eval_batches)) == \
        small.run.eval_batches
