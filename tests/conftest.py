"""Suite-wide test settings.

Tests use tiny tensors, where a second OpenMP thread buys nothing and, beside another busy
process, costs a lot: on the 2-core CI machine a forward+backward step ran ~8x slower with 2
threads than with 1 (0.4-0.6 s vs 3-6 s; tests/test_compare.py went from 125 s to 15 s).
Set SPEEDTRONIC_TEST_THREADS to change it.
"""

from __future__ import annotations

import os

import torch

torch.set_num_threads(int(os.environ.get("SPEEDTRONIC_TEST_THREADS", "1")))
