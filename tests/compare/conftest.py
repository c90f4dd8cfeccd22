"""Fixtures of the compare tests: one thread, a fresh CLI log handler, the tiny base YAML."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
import yaml
from _compare_fixtures import TINY


@pytest.fixture(autouse=True)
def _fresh_cli_logging():
    """The CLI binds its console handler to the sys.stdout of its first call; capsys swaps
    stdout per test, so drop the handler after each test."""
    yield
    root = logging.getLogger("speedtronic")
    for handler in [h for h in root.handlers if getattr(h, "_speedtronic_console", False)]:
        root.removeHandler(handler)


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny models gain nothing from a second thread, and on a shared CI host oversubscribed
    torch threads made these runs several times slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def tiny_yaml(tmp_path: Path) -> Path:
    path = tmp_path / "base.yaml"
    path.write_text(yaml.safe_dump(TINY), encoding="utf-8")
    return path
