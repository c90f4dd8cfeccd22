"""The cuBLASLt family of Newton-Schulz (``poly_lt``: b A + c A^2 with C != D, no copy of A),
on CPU with a fake op and fake timers: a candidate by default, used only where measured faster
and matching torch.baddbmm first, switched off by the environment or by any error. On a GPU
fp16 folds ``a I`` into its polynomial without the copy instead (nothing left for poly_lt)."""

from __future__ import annotations

import logging

import pytest
import torch
from _dispatch_fixtures import choices, counting_dispatch, run_orthogonalize

from speedtronic.kernels import newton_schulz as ns
from speedtronic.kernels import newton_schulz_gemm as gemm
from speedtronic.kernels.choice import MeasuredKernel


class FakePolyLt:
    """Stands in for speedtronic_debug.poly_lt(A, b, c) = b A + c A A."""

    def __init__(self, mode: str = "right"):
        self.mode, self.calls = mode, 0

    def __call__(self, A, b, c):
        self.calls += 1
        if self.mode == "raise":
            raise RuntimeError("poly_lt: cublasLtMatmul failed (cublasStatus 13)")
        if self.mode == "swapped":  # the classic bug: b and c exchanged
            b, c = c, b
        return (b * A.float() + c * (A.float() @ A.float())).to(A.dtype)


@pytest.fixture
def setup(monkeypatch):
    monkeypatch.delenv(ns.CUBLASLT_ENV, raising=False)
    monkeypatch.setenv(ns.SYM_GEMM_ENV, "0")

    def make(op: FakePolyLt, op_ms: float, env: str | None = None):
        if env is not None:
            monkeypatch.setenv(ns.CUBLASLT_ENV, env)
        family = MeasuredKernel(gemm.POLY_LT.name, "cublaslt", ns.CUBLASLT_ENV, True, lambda: op)
        monkeypatch.setattr(gemm, "POLY_LT", family)
        return counting_dispatch(monkeypatch, op, op_ms)

    return make


def _run(dtype=torch.float16):
    return run_orthogonalize(dtype)




@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_on_by_default_and_used_where_faster_and_correct(setup, dtype):
    op = FakePolyLt()
    d = setup(op, op_ms=0.5)
    out = _run(dtype)
    assert choices(d) == {f"poly_lt 2x16 {str(dtype)[6:]}": "cublaslt"}
    assert op.calls == 2 + 3  # one check, one timing, then all 3 iterations
    ref = ns.orthogonalize(torch.randn(2, 16, 40, generator=torch.Generator().manual_seed(0)),
                           3, list(ns.QUINTIC), 1e-7, torch.float32, "standard")
    torch.testing.assert_close(out.float(), ref, rtol=0.1, atol=0.1)


def test_the_gpu_fp16_route_folds_a_i_without_a_copy_and_never_asks_poly_lt(setup,
                                                                            monkeypatch):
    monkeypatch.setattr(gemm, "COPY_FREE_FOLD_ON_CPU", True)  # the route off the CPU
    op = FakePolyLt()
    d = setup(op, op_ms=0.01)
    out = _run(torch.float16)
    assert op.calls == 0 and choices(d) == {}
    ref = ns.orthogonalize(torch.randn(2, 16, 40, generator=torch.Generator().manual_seed(0)),
                           3, list(ns.QUINTIC), 1e-7, torch.float32, "standard")
    torch.testing.assert_close(out.float(), ref, rtol=0.02, atol=0.02)


def test_swapped_coefficients_are_caught_by_the_first_check(setup, caplog):
    op = FakePolyLt("swapped")
    d = setup(op, op_ms=0.1)
    with caplog.at_level(logging.WARNING, logger="speedtronic.newton_schulz"):
        _run()
    assert choices(d) == {} and op.calls == 1
    assert any("rejected" in r.getMessage() for r in caplog.records)


def test_slower_is_not_used(setup):
    op = FakePolyLt()
    d = setup(op, op_ms=0.99)
    _run()
    assert set(choices(d).values()) == {"cublas"} and op.calls == 2


def test_an_error_switches_the_family_off_once(setup, caplog):
    op = FakePolyLt("raise")
    setup(op, op_ms=0.1)
    with caplog.at_level(logging.WARNING, logger="speedtronic.newton_schulz"):
        out = _run()
        _run()
    assert op.calls == 1 and gemm.POLY_LT.disabled and out.isfinite().all()
    assert sum("disabled for this process" in r.getMessage() for r in caplog.records) == 1


def test_environment_switch_turns_it_off(setup):
    op = FakePolyLt()
    setup(op, op_ms=0.1, env="0")
    _run()
    assert op.calls == 0


def test_without_the_extension_there_is_no_candidate():
    assert gemm.POLY_LT.load() is None  # CPU torch: speedtronic._C is not loaded


def test_speedtronic_env_says_which_families_may_compete(monkeypatch):
    from speedtronic.cli.env import _optional_kernels

    op = FakePolyLt()
    monkeypatch.delenv(ns.CUBLASLT_ENV, raising=False)
    monkeypatch.delenv(ns.SYM_GEMM_ENV, raising=False)
    monkeypatch.setattr(gemm, "POLY_LT", MeasuredKernel("lt", "cublaslt", ns.CUBLASLT_ENV, True,
                                                      lambda: op))
    monkeypatch.setattr(gemm, "SYM_GEMM", MeasuredKernel("sym", "sym_gemm", ns.SYM_GEMM_ENV,
                                                       False, lambda: op))
    state = _optional_kernels()
    assert state["cublaslt"].startswith("candidate")
    assert state["sym_gemm"] == "off (SPEEDTRONIC_SYM_GEMM=1 to change)"
    gemm.POLY_LT.disable(RuntimeError("boom"))
    assert _optional_kernels()["cublaslt"] == "off after an error: RuntimeError: boom"
    monkeypatch.setattr(gemm, "POLY_LT", MeasuredKernel("lt", "cublaslt", ns.CUBLASLT_ENV, True,
                                                      lambda: None))
    assert _optional_kernels()["cublaslt"].startswith("unavailable")


class FakeNsStepLt:
    """Stands in for speedtronic_debug.ns_step_lt(X, A, a, b, c) = a X + (b A + c A A) X."""

    def __init__(self, mode: str = "right"):
        self.mode, self.calls = mode, 0

    def __call__(self, X, A, a, b, c):
        self.calls += 1
        if self.mode == "no_a":  # the a X term (the C operand) lost: what beta = 0 would do
            a = 0.0
        Xf, Af = X.float(), A.float()
        P = (b * Af + c * (Af @ Af)).to(X.dtype).float()               # rounded once, as cuBLASLt
        return (a * Xf + P @ Xf).to(X.dtype)


@pytest.fixture
def step_setup(monkeypatch):
    monkeypatch.delenv(ns.CUBLASLT_ENV, raising=False)
    monkeypatch.setenv(ns.SYM_GEMM_ENV, "0")

    def make(op: FakeNsStepLt, op_ms: float):
        family = MeasuredKernel(gemm.NS_STEP_LT.name, gemm.NS_STEP_LT.label, ns.CUBLASLT_ENV, True,
                                lambda: op)
        monkeypatch.setattr(gemm, "NS_STEP_LT", family)
        monkeypatch.setattr(gemm, "POLY_LT", MeasuredKernel("lt", "cublaslt", ns.CUBLASLT_ENV, True,
                                                          lambda: None))
        return counting_dispatch(monkeypatch, op, op_ms)

    return make


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_the_whole_iteration_in_cublaslt_is_used_where_faster_and_correct(step_setup, dtype):
    op = FakeNsStepLt()
    d = step_setup(op, op_ms=0.5)
    out = _run(dtype)
    assert choices(d) == {f"ns_step_lt 2x16x40 {str(dtype)[6:]}": "cublaslt_step"}
    assert op.calls == 2 + 3  # one check, one timing, then all 3 iterations
    ref = ns.orthogonalize(torch.randn(2, 16, 40, generator=torch.Generator().manual_seed(0)),
                           3, list(ns.QUINTIC), 1e-7, torch.float32, "standard")
    torch.testing.assert_close(out.float(), ref, rtol=0.05, atol=0.05)


def test_an_iteration_that_loses_the_a_x_term_is_rejected(step_setup, caplog):
    op = FakeNsStepLt("no_a")
    d = step_setup(op, op_ms=0.1)
    with caplog.at_level(logging.WARNING, logger="speedtronic.newton_schulz"):
        out = _run(torch.float16)
    assert choices(d) == {} and op.calls == 1
    assert any("ns_step_lt" in r.getMessage() and "rejected" in r.getMessage()
               for r in caplog.records)
    ref = ns.orthogonalize(torch.randn(2, 16, 40, generator=torch.Generator().manual_seed(0)),
                           3, list(ns.QUINTIC), 1e-7, torch.float32, "standard")
    torch.testing.assert_close(out.float(), ref, rtol=0.05, atol=0.05)  # the torch route's


def test_a_tall_result_keeps_the_torch_route_for_its_transposed_last_iteration(step_setup):
    op = FakeNsStepLt()
    step_setup(op, op_ms=0.5)
    G = torch.randn(2, 40, 16, generator=torch.Generator().manual_seed(0))  # tall: NS on G^T
    out = ns.orthogonalize(G, 3, list(ns.QUINTIC), 1e-7, torch.float16, "standard")
    assert out.shape == (2, 40, 16)
    assert op.calls == 2 + 2  # check, timing, then iterations 1-2; the 3rd writes (b, n, m)
    ref = ns.orthogonalize(G, 3, list(ns.QUINTIC), 1e-7, torch.float32, "standard")
    torch.testing.assert_close(out.float(), ref, rtol=0.05, atol=0.05)


def test_fp32_never_asks_the_16_bit_families(step_setup):
    op = FakeNsStepLt()
    d = step_setup(op, op_ms=0.1)
    _run(torch.float32)
    assert op.calls == 0 and choices(d) == {}
