"""The global batch under torchrun, decided from the config alone (no processes started)."""

from __future__ import annotations

import pytest

from speedtronic.config import ConfigError, load_config
from speedtronic.distributed.ddp import local_accumulation_steps


def test_an_unset_target_batch_is_one_micro_batch_per_rank(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    cfg = load_config({"data": {"micro_batch_size": 4}})
    assert cfg.data.target_batch_size == 8  # what config.yaml records
    assert local_accumulation_steps(cfg, 2) == 1
    monkeypatch.delenv("WORLD_SIZE")
    # the saved config on one process: the same global batch, by accumulation
    again = load_config(cfg.to_dict(redact=False))
    assert again.data.target_batch_size == 8 and again.accumulation_steps == 2


def test_a_set_target_batch_is_global(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    cfg = load_config({"data": {"micro_batch_size": 4, "target_batch_size": 16}})
    assert cfg.data.target_batch_size == 16
    assert local_accumulation_steps(cfg, 2) == 2
    assert local_accumulation_steps(cfg, 4) == 1


def test_a_global_batch_that_does_not_divide_names_both_fixes():
    cfg = load_config({"data": {"micro_batch_size": 16, "target_batch_size": 16}})
    with pytest.raises(ConfigError, match=r"data\.target_batch_size: 16 is the global batch.*"
                                          r"multiple of 32: set data\.target_batch_size: 32, "
                                          r"or data\.micro_batch_size: 8 \(keeps the global "
                                          r"batch of 16\)"):
        local_accumulation_steps(cfg, 2)
    odd = load_config({"data": {"micro_batch_size": 4, "target_batch_size": 4}})
    with pytest.raises(ConfigError, match=r"multiple of 12: set data\.target_batch_size: 12$"):
        local_accumulation_steps(odd, 3)
