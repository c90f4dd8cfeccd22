"""speedtronic.host_memory: glibc keeps a training step's freed memory instead of faulting it in
again next step; the opt-out and non-glibc platforms leave malloc alone and say so."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from speedtronic import host_memory

# Training steps of a small reference model (activations allocated in the forward, freed by the
# backward); prints the decision line, then the minor page faults of steps 3-6 (steps 1-2 let
# the heap and glibc's dynamic thresholds settle).
_STEPS = """
import resource
import torch
from speedtronic.config.schema import ModelConfig
from speedtronic.host_memory import tune_malloc
from speedtronic.models import extract_loss
from speedtronic.models.reference import ReferenceTransformer
print(tune_malloc())
torch.set_num_threads(1)
torch.manual_seed(0)
model = ReferenceTransformer(ModelConfig(vocab_size=256, max_seq_len=128, n_layer=2, n_head=4,
                                         n_kv_head=2, d_model=128))
x = torch.randint(0, 256, (8, 128))
def step():
    extract_loss(model(x, x)).backward()
step(); step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(4):
    step()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _steps(opt_out: bool) -> tuple[str, int]:
    env = dict(os.environ)
    env.pop(host_memory.HOST_MALLOC_ENV, None)
    for key in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_"):
        env.pop(key, None)
    if opt_out:
        env[host_memory.HOST_MALLOC_ENV] = "0"
    out = subprocess.run([sys.executable, "-c", _STEPS], capture_output=True, text=True,
                         env=env, timeout=300, check=True).stdout.splitlines()
    return out[-2], int(out[-1])


@pytest.mark.skipif(host_memory._glibc() is None, reason="glibc only")
def test_tuned_malloc_stops_refaulting_freed_step_memory():
    default_line, default_faults = _steps(opt_out=True)
    tuned_line, tuned_faults = _steps(opt_out=False)
    assert "defaults kept" in default_line and "SPEEDTRONIC_HOST_MALLOC=0" in default_line
    assert tuned_line.startswith("host malloc: glibc ") and "keeps freed memory" in tuned_line
    # glibc's defaults hand freed activations back to the kernel and fault them in again next
    # step (5,000-6,600 faults in 4 steps here); with the thresholds most pages stay mapped
    # (770-1,030).
    assert default_faults > 2000
    assert tuned_faults < default_faults / 3


def test_non_glibc_platform_is_left_alone_and_said(monkeypatch):
    monkeypatch.setattr(host_memory, "_applied", None)
    monkeypatch.delenv(host_memory.HOST_MALLOC_ENV, raising=False)
    monkeypatch.setattr(sys, "platform", "darwin")
    assert host_memory.tune_malloc() == "host malloc: unchanged (not glibc: darwin)"
    assert host_memory._applied is None  # a later call on a glibc system may still tune


def test_opt_out_is_read_at_each_call(monkeypatch):
    monkeypatch.setattr(host_memory, "_applied", None)
    monkeypatch.setenv(host_memory.HOST_MALLOC_ENV, "off")
    assert "defaults kept" in host_memory.tune_malloc()
    assert host_memory._applied is None
