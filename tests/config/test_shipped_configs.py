"""Every config under configs/ loads and validates (a renamed key would otherwise only surface
when a user runs it)."""

from __future__ import annotations

from pathlib import Path

import pytest

from speedtronic.config import load_config

CONFIGS = sorted((Path(__file__).resolve().parents[2] / "configs").glob("*.yaml"))


def test_there_are_shipped_configs():
    assert {p.name for p in CONFIGS} >= {"quickstart.yaml", "gpt2_small_gpu.yaml"}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_shipped_config_validates(path):
    cfg = load_config(path)
    assert cfg.run.max_steps > 0
