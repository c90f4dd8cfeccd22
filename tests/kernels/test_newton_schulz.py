"""Newton-Schulz math (kernels/newton_schulz.py): the standard and the Gram iteration against
float64, fp16 numerics, restart placement, and the op's normalized / method arguments."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from speedtronic.kernels import newton_schulz as ns
from speedtronic.kernels import newton_schulz_gemm as gemm
from speedtronic.kernels import ops

ROOT = Path(__file__).resolve().parents[2]
SCHEDULES = [(name, 5) for name in ns.COEFFICIENT_SCHEDULES]


def power_law(m: int, n: int, batch: int = 3, power: float = 1.0, seed: int = 0) -> torch.Tensor:
    """(batch, m, n) float64 with singular values i^-power (like real gradients)."""
    g = torch.Generator().manual_seed(seed)
    k = min(m, n)
    U, _ = torch.linalg.qr(torch.randn(batch, m, k, generator=g, dtype=torch.float64))
    V, _ = torch.linalg.qr(torch.randn(batch, n, k, generator=g, dtype=torch.float64))
    s = torch.arange(1, k + 1, dtype=torch.float64) ** -power
    return U @ torch.diag_embed(s.expand(batch, k)) @ V.mT


def gaussian(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def rank_deficient(m: int, n: int, rank: int) -> torch.Tensor:
    return gaussian(m, rank, seed=1) @ gaussian(rank, n, seed=2)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b).norm() / b.norm().clamp_min(1e-300))


def reference(G: torch.Tensor, schedule: str, steps: int) -> torch.Tensor:
    """Standard NS in float64 (the accuracy yardstick)."""
    coeffs = ns.resolve_coefficients(schedule, steps)
    return ns.orthogonalize(G.double(), steps, coeffs, 1e-7, torch.float64, "standard")


CASES = {
    "gaussian_wide": lambda: gaussian(2, 24, 96),
    "gaussian_tall": lambda: gaussian(2, 96, 24),
    "power_law_wide": lambda: power_law(24, 96),
    "power_law_tall": lambda: power_law(120, 30).contiguous(),
    "rank_deficient": lambda: rank_deficient(16, 64, 3),
    "one_row": lambda: gaussian(1, 40),
    "one_column": lambda: gaussian(40, 1),
    # m >= SYM_BLOCK_MIN_ROWS: the CPU path's blocked symmetric products
    "power_law_blocked": lambda: power_law(ns.SYM_BLOCK_MIN_ROWS + 6, 2 * ns.SYM_BLOCK_MIN_ROWS,
                                           batch=1),
}


@pytest.mark.parametrize("schedule,steps", SCHEDULES)
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("method", ["standard", "gram"])
def test_fp32_matches_float64_on_every_shape_and_schedule(schedule, steps, case, method):
    G = CASES[case]()
    ref = reference(G, schedule, steps)
    out = ns.orthogonalize(G.float(), steps, ns.resolve_coefficients(schedule, steps), 1e-7,
                           torch.float32, method)
    assert out.shape == G.shape and out.dtype == torch.float32
    assert rel(out, ref) < 1e-4, rel(out, ref)


def test_zero_matrix_stays_exactly_zero_in_every_dtype_and_method():
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        for method in ("standard", "gram"):
            out = ns.orthogonalize(torch.zeros(3, 8, 32), 5, list(ns.QUINTIC), 1e-7, dtype, method)
            assert torch.equal(out, torch.zeros(3, 8, 32))


@pytest.mark.parametrize("schedule,steps", SCHEDULES)
@pytest.mark.parametrize("spectrum", ["gaussian", "power_law"])
def test_fp16_is_far_more_accurate_than_bf16(schedule, steps, spectrum):
    G = gaussian(4, 32, 128) if spectrum == "gaussian" else power_law(32, 128, batch=4)
    ref = reference(G, schedule, steps)
    coeffs = ns.resolve_coefficients(schedule, steps)
    errors = {}
    for name, dtype in (("fp16", torch.float16), ("bf16", torch.bfloat16)):
        errors[name] = rel(ns.orthogonalize(G.float(), steps, coeffs, 1e-7, dtype, "auto"), ref)
    # fp16 (the CUDA default, with the Gram iteration and the folded a I term) against bf16
    # standard NS, which is what torch.optim.Muon computes.
    assert errors["fp16"] < 1e-2 and errors["fp16"] * 2.5 < errors["bf16"], errors


def test_fp16_never_overflows_whatever_the_gradient_scale():
    coeffs = ns.polar_express_coefficients(5)  # the largest coefficients shipped
    for scale in (1e-30, 1e-4, 1.0, 1e4, 1e30):
        G = (power_law(16, 64, power=2.0) * scale).float()
        for method in ("standard", "gram"):
            out = ns.orthogonalize(G, 5, coeffs, 1e-7, torch.float16, method)
            assert torch.isfinite(out).all(), (scale, method)


def test_gram_without_restarts_diverges_and_the_shipped_restarts_do_not():
    G = power_law(32, 128, batch=2, power=2.0)
    coeffs = ns._iter_coefficients(ns.polar_express_coefficients(5), 5)
    ref = reference(G, "polar_express", 5)
    X = (G / G.norm(dim=(-2, -1), keepdim=True)).to(torch.float16)
    untamed = rel(ns.ns_gram(X, coeffs, (), transpose_out=False), ref)
    tamed = rel(ns.ns_gram(X, coeffs, ns.GRAM_RESTARTS["polar_express"], transpose_out=False), ref)
    standard = rel(ns.ns_standard(X, coeffs, transpose_out=False), ref)
    assert not untamed < 10 * standard, (untamed, standard)  # diverged (NaN counts)
    assert tamed < 1.5 * standard, (tamed, standard)


def test_shipped_restarts_are_the_committed_tuning_result():
    result = json.loads((ROOT / "benchmarks" / "results" / "gram_restarts.json").read_text())
    chosen = {name: tuple(s["chosen"]) for name, s in result["tune"]["schedules"].items()}
    assert chosen == ns.GRAM_RESTARTS


def test_untuned_coefficients_and_bf16_use_standard_ns():
    G = gaussian(2, 16, 64).float()
    custom = [3.0, -3.2, 1.2]
    assert ns.schedule_name(custom, 5) is None and ns.gram_restarts(custom, 5) is None
    assert ns.schedule_name(list(ns.QUINTIC) * 5, 5) == "quintic"
    for coeffs, dtype in ((custom, torch.float32), (list(ns.QUINTIC), torch.bfloat16)):
        a = ns.orthogonalize(G, 5, coeffs, 1e-7, dtype, "gram")
        b = ns.orthogonalize(G, 5, coeffs, 1e-7, dtype, "standard")
        assert torch.equal(a, b)


def test_normalized_input_skips_the_second_normalization_and_is_not_modified():
    G = gaussian(3, 16, 48).float()
    X = G / (torch.linalg.vector_norm(G, dim=(-2, -1), keepdim=True) + 1e-7)
    before = X.clone()
    a = ops.newton_schulz(X, 5, list(ops.QUINTIC), 1e-7, torch.float32, "auto", True)
    b = ops.newton_schulz(G, 5, list(ops.QUINTIC), 1e-7, torch.float32, "auto", False)
    assert torch.equal(X, before)
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_auto_dtype_is_fp16_on_cuda_and_fp32_on_cpu():
    assert ns.resolve_compute_dtype(torch.device("cuda"), torch.float32) == torch.float16
    assert ns.resolve_compute_dtype(torch.device("cpu"), torch.float32) == torch.float32
    assert ns.resolve_compute_dtype(torch.device("cuda"), torch.float64) == torch.float64
    assert ns.resolve_compute_dtype(torch.device("cuda"), torch.float32,
                                    torch.bfloat16) == torch.bfloat16


def test_bad_method_is_a_clear_error():
    with pytest.raises(ValueError, match="method must be one of auto, standard, gram"):
        ops.newton_schulz(torch.randn(4, 8), 5, list(ops.QUINTIC), 1e-7, None, "fast")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("m", [ns.SYM_BLOCK_MIN_ROWS, ns.SYM_BLOCK_MIN_ROWS + 37])
def test_blocked_symmetric_product_equals_the_full_gemm(dtype, m):
    # The CPU path computes X X^T and A A on the block-lower triangle and mirrors it: the result
    # must be the full product (to rounding), including uneven blocks, with every entry written.
    X = gaussian(2, m, m + 50, seed=3).to(dtype)
    out = ns._sym_bmm(X, X)
    assert out.shape == (2, m, m) and out.dtype == dtype
    torch.testing.assert_close(out, out.mT, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(out, torch.bmm(X, X.mT), rtol=1e-5, atol=1e-3)
    A = out / out.norm(dim=(-2, -1), keepdim=True)
    torch.testing.assert_close(ns._sym_bmm(A, A), torch.bmm(A, A), rtol=1e-5, atol=1e-6)


def test_small_and_16_bit_products_are_one_plain_gemm():
    # Below the threshold (and in 16 bits, where a strided bmm output is slower on CPU) the
    # product is one bmm: the op count of small shapes stays what the launch budget assumes.
    from speedtronic.kernels.counting import DispatchCounter

    for X in (gaussian(2, ns.SYM_BLOCK_MIN_ROWS - 1, 300).float(),
              gaussian(2, ns.SYM_BLOCK_MIN_ROWS, 300).to(torch.bfloat16)):
        with DispatchCounter() as counter:
            ns._sym_bmm(X, X)
        assert counter.by_name == {"bmm": 1}
    with DispatchCounter() as counter:
        ns._sym_bmm(*(2 * [gaussian(2, ns.SYM_BLOCK_MIN_ROWS, 300).float()]))
    assert counter.by_name["bmm"] == 4


@pytest.mark.parametrize("shape", [(4, 64, 64), (2, 64, 192), (2, 256, 256)])
def test_bf16_is_as_accurate_as_torch_muons_bf16_iteration(shape):
    # Equal precision means equal error: our bf16 NS may not be worse than torch.optim.Muon's
    # (addmm with beta, one rounding per product). A bmm + add_(X, alpha=a) once rounded a
    # itself to bf16 (3.4445 -> 3.4375) and doubled the error.
    from torch.optim._muon import _zeropower_via_newtonschulz

    G = gaussian(*shape, seed=5)
    ref = reference(G, "quintic", 5)
    theirs = torch.stack([_zeropower_via_newtonschulz(g.float(), ns.QUINTIC, 5, 1e-7)
                          for g in G])
    ours = ns.orthogonalize(G.float(), 5, ns.QUINTIC, 1e-7, torch.bfloat16)
    assert rel(ours, ref) <= 1.1 * rel(theirs, ref), (rel(ours, ref), rel(theirs, ref))


# ---- the CPU workspace: products written into persistent buffers ---------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(2, 256, 256), (2, 256, 768), (2, 768, 256)])
@pytest.mark.parametrize("schedule", ["quintic", "polar_express"])
def test_a_workspace_changes_no_bit_and_is_reused_by_the_next_call(dtype, shape, schedule):
    """Inside ``workspace_scope`` every product goes into kept buffers (standard, Gram with one
    or two restarts, tall output): the result is bitwise the allocating one, the input is not
    written, and a second call allocates nothing and returns in the same buffer."""
    from speedtronic.kernels.newton_schulz import Workspace, orthogonalize, workspace_scope

    torch.manual_seed(0)
    G = torch.randn(*shape).to(dtype)
    G = G / G.float().norm(dim=(-2, -1), keepdim=True).to(dtype)
    before = G.clone()
    coeffs = ops.resolve_coefficients(schedule, 5)
    expected = orthogonalize(G, 5, coeffs, 1e-7, dtype, "auto", True)
    ws = Workspace()
    with workspace_scope(ws):
        got = orthogonalize(G, 5, coeffs, 1e-7, dtype, "auto", True)
        held, ptr = ws.nbytes, got.data_ptr()
        again = orthogonalize(G, 5, coeffs, 1e-7, dtype, "auto", True)
    assert torch.equal(got, expected) and torch.equal(again, expected)
    assert torch.equal(G, before)
    assert ws.nbytes == held > 0 and again.data_ptr() == ptr
    assert orthogonalize(G, 5, coeffs, 1e-7, dtype, "auto", True).data_ptr() != ptr  # scope ended


def test_the_workspace_never_hands_out_a_live_buffer_and_serves_smaller_batches():
    from speedtronic.kernels.newton_schulz import Workspace

    ws = Workspace()
    like = torch.empty(())
    a = ws.out((4, 8, 8), like, [])
    b = ws.out((4, 8, 8), like, [a])
    c = ws.out((4, 8, 8), like, [a, b])
    ptrs = {t.untyped_storage().data_ptr() for t in (a, b, c)}
    assert len(ptrs) == 3
    assert ws.out((4, 8, 8), like, [a, c]).data_ptr() == b.data_ptr()  # reuses the free one
    small = ws.out((2, 8, 8), like, [a[:1]])  # a view of a live buffer keeps it live
    assert small.shape == (2, 8, 8) and small.untyped_storage().data_ptr() != a.data_ptr()
    assert ws.nbytes == 3 * 4 * 8 * 8 * 4


# ---- the GPU's copy-free fold (a I + b A + c A^2 in an add and an in-place GEMM) -------------

@pytest.mark.parametrize("method", ["standard", "gram"])
@pytest.mark.parametrize("schedule", ["quintic", "polar_express"])
@pytest.mark.parametrize("workspace", [False, True])
def test_the_gpu_fold_route_matches_the_cpu_route_and_float64(monkeypatch, method, schedule,
                                                              workspace):
    """The route off the CPU (``A + (a/b) I`` then ``baddbmm_`` with beta = b) is the same
    polynomial: in fp64 it agrees with the plain product plus diagonal add to rounding, and in
    fp32 it is as close to float64 as the CPU route, with and without a workspace."""
    G = power_law(48, 144)
    coeffs = ops.resolve_coefficients(schedule, 5)
    ref = reference(G, schedule, 5)
    cpu64 = ns.orthogonalize(G, 5, coeffs, 1e-7, torch.float64, method)
    cpu32 = ns.orthogonalize(G.float(), 5, coeffs, 1e-7, torch.float32, method)
    monkeypatch.setattr(gemm, "COPY_FREE_FOLD_ON_CPU", True)
    scope = ns.workspace_scope(ns.Workspace()) if workspace else None
    with scope if scope is not None else torch.no_grad():
        gpu64 = ns.orthogonalize(G, 5, coeffs, 1e-7, torch.float64, method).clone()
        gpu32 = ns.orthogonalize(G.float(), 5, coeffs, 1e-7, torch.float32, method).clone()
    assert rel(gpu64, cpu64) < 1e-12
    assert rel(gpu32, ref) <= 1.5 * rel(cpu32, ref) + 1e-6, (rel(gpu32, ref), rel(cpu32, ref))


def test_the_gpu_fold_costs_two_ops_per_polynomial_and_no_diagonal_add(monkeypatch):
    # The launch arithmetic of tests/optim/test_step_budget.py: xxt, add, baddbmm_, bmm per
    # standard iteration (4, was 5 with baddbmm's copy and the a I diagonal add).
    from speedtronic.kernels.counting import DispatchCounter

    monkeypatch.setattr(gemm, "COPY_FREE_FOLD_ON_CPU", True)
    X = gaussian(2, 32, 96).half()
    X = X / X.float().norm(dim=(-2, -1), keepdim=True).half()
    ns.orthogonalize(X, 5, list(ns.QUINTIC), 1e-7, torch.float16, "standard", True)  # eye cached
    with DispatchCounter() as counter:
        ns.orthogonalize(X, 5, list(ns.QUINTIC), 1e-7, torch.float16, "standard", True)
    assert counter.by_name == {"bmm": 10, "add": 5, "baddbmm_": 5}, counter.by_name
    assert counter.launches == 20
