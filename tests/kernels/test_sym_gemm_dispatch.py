"""Dispatch of the Hopper symmetric kernel inside Newton-Schulz (kernels/newton_schulz_gemm.py),
on CPU with a fake kernel and fake timers: off by default, used only where measured faster and
checked correct, switched off by the environment or by any error (one log line)."""

from __future__ import annotations

import logging

import pytest
import torch
from _dispatch_fixtures import choices, counting_dispatch, run_orthogonalize

from speedtronic.kernels import autotune
from speedtronic.kernels import newton_schulz as ns
from speedtronic.kernels import newton_schulz_gemm as gemm
from speedtronic.kernels.choice import MeasuredKernel


class FakeKernel:
    """Stands in for speedtronic_debug.sym_gemm(X, alpha, beta, C): alpha X X^T + beta C."""

    def __init__(self, mode: str = "right"):
        self.mode = mode
        self.calls = 0

    def __call__(self, X, alpha, beta, C):
        self.calls += 1
        if self.mode == "raise":
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        out = alpha * (X.float() @ X.float().mT)
        if C is not None:
            out = out + beta * C.float()
        if self.mode == "asymmetric":
            out[..., 0, 1] += 1.0
        return out.to(X.dtype)


@pytest.fixture
def setup(monkeypatch):
    monkeypatch.delenv(ns.SYM_GEMM_ENV, raising=False)
    monkeypatch.setenv(ns.CUBLASLT_ENV, "0")  # this file is about the Hopper family alone

    def make(kernel: FakeKernel, kernel_ms: float, env: str | None = "1"):
        if env is not None:
            monkeypatch.setenv(ns.SYM_GEMM_ENV, env)
        family = MeasuredKernel(gemm.SYM_GEMM.name, "sym_gemm", ns.SYM_GEMM_ENV,
                                ns.SYM_GEMM_DEFAULT_ON, lambda: kernel, symmetric=True)
        monkeypatch.setattr(gemm, "SYM_GEMM", family)
        return counting_dispatch(monkeypatch, kernel, kernel_ms)

    return make


def _run(dtype=torch.bfloat16):
    return run_orthogonalize(dtype)




def test_off_by_default_even_when_it_would_measure_faster(setup):
    k = FakeKernel()
    d = setup(k, kernel_ms=0.1, env=None)
    assert not ns.SYM_GEMM_DEFAULT_ON
    _run()
    assert k.calls == 0 and choices(d) == {}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_used_where_measured_faster_and_correct(setup, dtype):
    k = FakeKernel()
    d = setup(k, kernel_ms=0.5)
    ref_calls = k.calls
    out = _run(dtype)
    assert choices(d) == {
        f"sym_gemm xxt 2x16x40 {str(dtype)[6:]}": "sym_gemm",
        f"sym_gemm poly 2x16 {str(dtype)[6:]}": "sym_gemm",
    }
    # per key: one check, one timing; then every one of the 3 iterations runs it
    assert k.calls - ref_calls == 2 * 2 + 2 * 3
    G = torch.randn(2, 16, 40, generator=torch.Generator().manual_seed(0))
    ref = ns.orthogonalize(G, 3, list(ns.QUINTIC), 1e-7, torch.float32, "standard")
    torch.testing.assert_close(out.float(), ref, rtol=0.1, atol=0.1)


def test_not_used_where_cublas_is_faster(setup):
    k = FakeKernel()
    d = setup(k, kernel_ms=0.97)  # < 5% faster: the default (cuBLAS) stays
    _run()
    assert set(choices(d).values()) == {"cublas"}
    assert k.calls == 2 * 2  # the check and the timing, per key; never in the iterations


def test_a_wrong_result_is_rejected_before_timing(setup, caplog):
    k = FakeKernel("asymmetric")
    d = setup(k, kernel_ms=0.1)
    with caplog.at_level(logging.WARNING, logger="speedtronic.newton_schulz"):
        out = _run()
    assert choices(d) == {}  # never timed
    assert sum("rejected" in r.getMessage() for r in caplog.records) == 2  # xxt and poly, once each
    assert k.calls == 2 and out.isfinite().all()


def test_an_error_disables_the_family_with_one_log_line(setup, caplog):
    k = FakeKernel("raise")
    setup(k, kernel_ms=0.1)
    with caplog.at_level(logging.WARNING, logger="speedtronic.newton_schulz"):
        out = _run()
        _run()
    assert k.calls == 1
    assert sum("disabled for this process" in r.getMessage() for r in caplog.records) == 1
    assert gemm.SYM_GEMM.disabled and out.isfinite().all()


def test_environment_switch_turns_it_off(setup):
    k = FakeKernel()
    setup(k, kernel_ms=0.1, env="0")
    _run()
    assert k.calls == 0


def test_nothing_is_checked_or_timed_inside_a_graph_capture(setup, monkeypatch):
    k = FakeKernel()
    d = setup(k, kernel_ms=0.1)
    monkeypatch.setattr(autotune, "_capturing", lambda: True)
    _run()
    assert k.calls == 0 and choices(d) == {}


def test_fp32_never_looks_for_the_kernel(setup):
    k = FakeKernel()
    setup(k, kernel_ms=0.1)
    _run(torch.float32)
    assert k.calls == 0


def test_gpu_benchmark_plans_the_issue_table_without_a_gpu(monkeypatch, capsys):
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).parents[2] / "benchmarks" / "bench_sym_gemm.py"
    spec = importlib.util.spec_from_file_location("bench_sym_gemm", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    rows = mod.plan()
    xxt = {(r["dtype"], r["m"], r["k"]) for r in rows if r["op"] == "xxt"}
    assert xxt == {(d, m, k) for d in ("float16", "bfloat16")
                   for m in (512, 768, 1024, 2048, 4096, 8192) for k in (m, 4 * m)}
    monkeypatch.setattr(sys, "argv", ["bench_sym_gemm.py", "--dry-run"])
    assert mod.main() == 0 and "36 rows planned" in capsys.readouterr().out
