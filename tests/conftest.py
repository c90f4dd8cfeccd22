"""Suite-wide test settings.

Tests use tiny tensors, where a second OpenMP thread buys nothing and, beside another busy
process, costs a lot: on the 2-core CI machine a forward+backward step ran ~8x slower with 2
threads than with 1 (0.4-0.6 s vs 3-6 s; tests/compare/ went from 125 s to 15 s).
Set SPEEDTRONIC_TEST_THREADS to change it.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

# Shared helpers (_engine_fixtures.py) live in tests/; test files in subfolders import them by
# name, which --import-mode=importlib (pyproject.toml) does not arrange by itself.
sys.path.insert(0, str(Path(__file__).resolve().parent))

torch.set_num_threads(int(os.environ.get("SPEEDTRONIC_TEST_THREADS", "1")))


@pytest.fixture(autouse=True)
def _host_malloc_left_alone(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """``speedtronic train`` tunes glibc malloc for the whole process (train.host_memory):
    tests that run the CLI in this process log the opt-out decision instead.
    tests/train/test_host_memory.py tunes for real, in subprocesses."""
    from speedtronic.train import host_memory

    monkeypatch.setenv(host_memory.HOST_MALLOC_ENV, "0")
    yield
