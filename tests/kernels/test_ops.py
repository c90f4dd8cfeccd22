"""kernels.ops: opcheck for every op, numerics against float64 references, compile tracing."""

from __future__ import annotations

import pytest
import torch

from speedtronic.kernels import ops

OPS = torch.ops.speedtronic


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randn(*shape: int, seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=_gen(seed), dtype=torch.float64).to(dtype)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


# ---- float64 references written from the formulas, independent of the ops ----------------------

def ref_newton_schulz(G: torch.Tensor, coeffs: list[float], steps: int, eps: float = 1e-7):
    X = G.double()
    tall = X.size(-2) > X.size(-1)
    if tall:
        X = X.mT
    X = X / torch.linalg.vector_norm(X, dim=(-2, -1), keepdim=True).clamp(min=eps)
    for k in range(steps):
        a, b, c = coeffs[3 * k:3 * k + 3] if len(coeffs) > 3 else coeffs
        A = X @ X.mT
        X = a * X + (b * A + c * A @ A) @ X
    return X.mT if tall else X


def ref_muon_plus(U: torch.Tensor, eps: float) -> torch.Tensor:
    U = U.double()
    out = torch.empty_like(U)
    for idx in range(U.size(0)) if U.dim() == 3 else [None]:
        M = U[idx] if idx is not None else U
        R = M / torch.sqrt((M ** 2).sum(dim=1, keepdim=True) + eps)
        C = R / torch.sqrt((R ** 2).sum(dim=0, keepdim=True) + eps)
        if idx is None:
            return C
        out[idx] = C
    return out


def ref_cautious(u: torch.Tensor, g: torch.Tensor, rescale: bool) -> torch.Tensor:
    u, g = u.double(), g.double()
    mask = (u * g > 0).double()
    out = u * mask
    return out * (u.numel() / (mask.sum() + 1)) if rescale else out


# ---- opcheck ----------------------------------------------------------------------------------

def _opcheck_cases():
    g = _gen(1)
    bufs = [torch.randn(6, 4, generator=g) for _ in range(3)]
    grads = [torch.randn(6, 4, generator=g) for _ in range(3)]
    params = [torch.randn(6, 4, generator=g) for _ in range(3)]
    orth = torch.randn(3, 6, 4, generator=g)
    lst = [torch.randn(5, generator=g), torch.randn(3, 2, generator=g)]
    return [
        (OPS.newton_schulz.default, (torch.randn(8, 5, generator=g),), {}),
        (OPS.newton_schulz.default, (torch.randn(2, 5, 12, generator=g), 3,
                                     ops.polar_express_coefficients(3), 1e-7, torch.float32), {}),
        (OPS.muon_plus_normalize.default, (torch.randn(2, 6, 4, generator=g), 1e-8), {}),
        (OPS.cautious_mask_.default, ([t.clone() for t in lst], [torch.randn_like(t) for t in lst],
                                      True), {}),
        (OPS.muon_pre_orthogonalize_.default, ([b.clone() for b in bufs], grads, 0.95, True, 1e-7,
                                               torch.float32), {}),
        (OPS.muon_post_update_.default, ([p.clone() for p in params], orth, grads, 0.02, 0.1, 1.5,
                                         True, 1e-8, True, True), {}),
        (OPS.cautious_adamw_step_.default, ([p.clone() for p in params], grads,
                                            [torch.zeros(6, 4) for _ in range(3)],
                                            [torch.zeros(6, 4) for _ in range(3)], 1e-3, 0.9,
                                            0.95, 1e-8, 0.1, 1, True, True), {}),
    ]


@pytest.mark.parametrize("case", range(7))
def test_opcheck(case: int) -> None:
    op, args, kwargs = _opcheck_cases()[case]
    torch.library.opcheck(op, args, kwargs)


def test_schemas_match_the_brief() -> None:
    # The CUDA kernels implement exactly these schemas; a change here must be coordinated.
    schema = str(OPS.cautious_adamw_step_.default._schema)
    assert "Tensor(a!)[] params" in schema and "Tensor(b!)[] exp_avgs" in schema
    assert "ScalarType? compute_dtype=None" in str(OPS.newton_schulz.default._schema)
    assert "Tensor(a!)[] momentum_buffers" in str(OPS.muon_pre_orthogonalize_.default._schema)


# ---- newton_schulz ----------------------------------------------------------------------------

@pytest.mark.parametrize("shape", [(32, 32), (24, 64), (64, 24), (3, 16, 40), (3, 40, 16),
                                   (2, 16, 96)])
@pytest.mark.parametrize("schedule", ["quintic", "polar_express"])
def test_newton_schulz_matches_float64_reference(shape, schedule) -> None:
    G = _randn(*shape, seed=3)
    coeffs = ops.resolve_coefficients(schedule, 5)
    out = ops.newton_schulz(G, 5, coeffs)
    assert out.shape == G.shape and out.dtype == G.dtype
    assert _rel(out, ref_newton_schulz(G, coeffs, 5)) < 1e-4


def test_newton_schulz_batch_equals_each_matrix() -> None:
    G = _randn(4, 20, 50, seed=4)
    batched = ops.newton_schulz(G)
    for i in range(4):
        assert _rel(batched[i], ops.newton_schulz(G[i])) < 1e-6


def test_newton_schulz_singular_values_in_quintic_band() -> None:
    # Output singular values are p^5(sigma_i / ||G||_F) for the scalar quintic p: check both the
    # exact prediction and that they sit in the band [min, max] of p^5 over [sigma_min, 1].
    G = _randn(48, 96, seed=5)
    out = ops.newton_schulz(G, 5)
    s_in = torch.linalg.svdvals(G.double()) / torch.linalg.matrix_norm(G.double())
    a, b, c = ops.QUINTIC

    def p5(x: torch.Tensor) -> torch.Tensor:
        for _ in range(5):
            x = a * x + b * x ** 3 + c * x ** 5
        return x

    predicted = torch.sort(p5(s_in)).values
    actual = torch.sort(torch.linalg.svdvals(out.double())).values
    assert torch.allclose(actual, predicted, atol=1e-4)
    band = p5(torch.linspace(s_in.min().item(), 1.0, 20001, dtype=torch.float64))
    assert actual.min() >= band.min() - 1e-4 and actual.max() <= band.max() + 1e-4
    # Known shape of Keller's quintic: not exactly orthogonal, but in roughly [0.6, 1.2].
    assert 0.6 < actual.min() and actual.max() < 1.2


def test_newton_schulz_zero_matrix_stays_finite_and_input_untouched() -> None:
    Z = torch.zeros(2, 8, 16)
    assert torch.equal(ops.newton_schulz(Z), Z)
    G = _randn(8, 16, seed=6)
    before = G.clone()
    ops.newton_schulz(G)
    assert torch.equal(G, before)


def test_newton_schulz_compute_dtype_and_float64() -> None:
    G = _randn(16, 32, seed=7)
    ref = ref_newton_schulz(G, list(ops.QUINTIC), 5)
    bf16 = ops.newton_schulz(G, compute_dtype=torch.bfloat16)
    assert bf16.dtype == torch.float32 and 1e-5 < _rel(bf16, ref) < 5e-2
    assert _rel(ops.newton_schulz(G.double()), ref) < 1e-12  # fp64 input stays fp64
    # fp64 in, a narrower matmul dtype: the result keeps G's dtype (the norm once refused to
    # narrow fp64 to fp32 and raised)
    narrow = ops.newton_schulz(G.double(), compute_dtype=torch.float32)
    assert narrow.dtype == torch.float64 and _rel(narrow, ref) < 1e-5


def test_newton_schulz_of_a_huge_finite_matrix_is_its_polar_factor() -> None:
    # ||G||_F ~ 2e19: its fp32 sum of squares overflows; the output was all zeros.
    G = _randn(16, 32, seed=8) * 1e18
    ref = ref_newton_schulz(G, list(ops.QUINTIC), 5)
    assert _rel(ops.newton_schulz(G), ref) < 1e-5


def test_the_norm_without_fp64_matches_and_never_overflows(monkeypatch) -> None:
    """MPS has no float64, and the op's norm accumulated in it ("Cannot convert a MPS Tensor to
    float64"): there it divides by the largest magnitude first and sums in fp32."""
    from speedtronic.kernels.newton_schulz import frobenius_norm

    for scale in (1.0, 1e-30, 1e18, 1e36):
        G = torch.stack([_randn(16, 32, seed=8), _randn(16, 32, seed=9)]) * scale   # (2, 16, 32)
        fp32 = frobenius_norm(G, fp64=False)
        assert fp32.dtype == torch.float32 and fp32.shape == (2, 1, 1)
        assert torch.allclose(fp32.double(), frobenius_norm(G), rtol=1e-6), scale
    assert frobenius_norm(torch.zeros(1, 4, 4), fp64=False).item() == 0.0
    # the op as an MPS tensor runs it (no MPS here: the fp32 route forced), on the huge
    # matrix above: no float64 op anywhere, and still its polar factor
    G = _randn(16, 32, seed=8) * 1e18
    seen: list[torch.dtype] = []

    class NoFloat64(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if isinstance(out, torch.Tensor):
                seen.append(out.dtype)
            return out

    from speedtronic.kernels import newton_schulz as ns

    real = ns.frobenius_norm
    monkeypatch.setattr(ns, "frobenius_norm", lambda X, fp64=True: real(X, fp64=False))
    with NoFloat64():
        out = ns.orthogonalize(G, 5, list(ops.QUINTIC), 1e-7, torch.float32)
    assert torch.float64 not in seen
    assert _rel(out, ref_newton_schulz(G, list(ops.QUINTIC), 5)) < 1e-5


def test_fake_kernels_refuse_what_the_real_ones_refuse() -> None:
    # Under torch.compile the fake kernels run at trace time: a bad call must fail there too.
    from torch._subclasses.fake_tensor import FakeTensorMode

    def calls(t):
        m = [t(4, 4), t(4, 4)]
        return {
            "pre: count": lambda: ops.muon_pre_orthogonalize_(m, m[:1], 0.9, True, 1e-7,
                                                                torch.float32),
            "pre: bf16 buffers": lambda: ops.muon_pre_orthogonalize_(
                [x.bfloat16() for x in m], m, 0.9, True, 1e-7, torch.float32),
            "mask: count": lambda: ops.cautious_mask_(m, []),
            "post: batch": lambda: ops.muon_post_update_(m, t(3, 4, 4), m, 0.1, 0.0, 1.0, False,
                                                         1e-8, False, True),
            "adamw: lengths": lambda: ops.cautious_adamw_step_(m, m[:1], m, m, 1e-3, 0.9, 0.99,
                                                               1e-8, 0.0, 1, False, True),
            "adamw: step 0": lambda: ops.cautious_adamw_step_(m, m, m, m, 1e-3, 0.9, 0.99, 1e-8,
                                                              0.0, 0, False, True),
        }

    for real in calls(torch.zeros).values():
        with pytest.raises(ValueError):
            real()
    with FakeTensorMode():
        for fake in calls(torch.zeros).values():
            with pytest.raises(ValueError):
                fake()


def test_newton_schulz_bad_arguments() -> None:
    with pytest.raises(ValueError, match="coefficients"):
        ops.newton_schulz(torch.randn(4, 4), 5, [1.0, 2.0])
    with pytest.raises(ValueError, match=r"\(m, n\)"):
        ops.newton_schulz(torch.randn(4))
    with pytest.raises(ValueError, match="steps"):
        ops.newton_schulz(torch.randn(4, 4), 0)


def test_coefficient_schedules() -> None:
    pe = ops.polar_express_coefficients(10)
    assert len(pe) == 30
    # Past the 8 published polynomials the last one repeats.
    assert pe[-3:] == list(ops.POLAR_EXPRESS_PUBLISHED[-1]) == pe[-6:-3]
    # The second entry is the published one divided by the 1.01 safety factor.
    a, b, c = ops.POLAR_EXPRESS_PUBLISHED[1]
    assert pe[3:6] == pytest.approx([a / 1.01, b / 1.01 ** 3, c / 1.01 ** 5])
    # Equivalent to the paper's Algorithm 1 (normalize by 1.01 ||X||_F, safety-scaled table).
    G = _randn(24, 48, seed=8).double()
    X = G / (G.norm() * 1.01)
    for a, b, c in [(a / 1.01, b / 1.01 ** 3, c / 1.01 ** 5)
                    for a, b, c in ops.POLAR_EXPRESS_PUBLISHED[:5]]:
        A = X @ X.T
        X = a * X + (b * A + c * A @ A) @ X
    assert _rel(ops.newton_schulz(G, 5, ops.polar_express_coefficients(5), 0.0), X) < 1e-10
    assert ops.resolve_coefficients("quintic", 5) == list(ops.QUINTIC)
    with pytest.raises(ValueError, match="polar_express"):
        ops.resolve_coefficients("cubic", 5)


# ---- muon_plus_normalize / cautious_mask_ -----------------------------------------------------

@pytest.mark.parametrize("shape", [(12, 7), (3, 12, 7)])
def test_muon_plus_matches_float64(shape) -> None:
    U = _randn(*shape, seed=9)
    out = ops.muon_plus_normalize(U, 1e-8)
    assert _rel(out, ref_muon_plus(U, 1e-8)) < 1e-6
    # Columns were normalized last, so each has unit norm.
    cols = out.double().norm(dim=-2)
    assert torch.allclose(cols, torch.ones_like(cols), atol=1e-5)


def test_muon_plus_eps_inside_sqrt_and_bf16() -> None:
    U = torch.zeros(4, 3)
    assert torch.equal(ops.muon_plus_normalize(U, 1e-8), U)  # zero rows stay zero, finite
    Ub = _randn(8, 5, seed=10, dtype=torch.bfloat16)
    out = ops.muon_plus_normalize(Ub)
    assert out.dtype == torch.bfloat16 and _rel(out, ref_muon_plus(Ub, 1e-8)) < 1e-2


@pytest.mark.parametrize("rescale", [True, False])
def test_cautious_mask_matches_float64(rescale: bool) -> None:
    ups = [_randn(40, seed=11), _randn(6, 7, seed=12)]
    grads = [_randn(40, seed=13), _randn(6, 7, seed=14)]
    expected = [ref_cautious(u, g, rescale) for u, g in zip(ups, grads, strict=True)]
    ops.cautious_mask_(ups, grads, rescale)
    for got, exp in zip(ups, expected, strict=True):
        assert _rel(got, exp) < 1e-6


def test_cautious_mask_keeps_small_fp16_entries_whose_signs_agree() -> None:
    # 1e-4 * 1e-4 is 0 in fp16 (smallest subnormal 6e-8): a product test there dropped them
    u = torch.tensor([1e-4, -1e-4, 1e-4, 0.5], dtype=torch.float16)
    g = torch.tensor([1e-4, -1e-4, -1e-4, 0.5], dtype=torch.float16)
    ops.cautious_mask_([u], [g], False)
    assert u.tolist() == pytest.approx([1e-4, -1e-4, 0.0, 0.5], rel=1e-3)


# ---- fused-shaped Muon / AdamW ops -----------------------------------------------------------

def test_muon_pre_orthogonalize_matches_reference() -> None:
    bufs = [_randn(6, 4, seed=s) for s in (20, 21)]
    grads = [_randn(6, 4, seed=s, dtype=torch.bfloat16) for s in (22, 23)]
    mu, eps = 0.9, 1e-7
    exp_bufs = [mu * b.double() + (1 - mu) * g.double() for b, g in zip(bufs, grads, strict=True)]
    exp = [g.double() + mu * (b - g.double()) for b, g in zip(exp_bufs, grads, strict=True)]
    exp = torch.stack([e / e.norm().clamp(min=eps) for e in exp])
    out = ops.muon_pre_orthogonalize_(bufs, grads, mu, True, eps, torch.float32)
    assert out.shape == (2, 6, 4) and out.dtype == torch.float32
    assert _rel(out, exp) < 1e-6
    for b, e in zip(bufs, exp_bufs, strict=True):
        assert b.dtype == torch.float32 and _rel(b, e) < 1e-6
    out = ops.muon_pre_orthogonalize_(bufs, grads, mu, False, eps, torch.bfloat16)
    assert out.dtype == torch.bfloat16


@pytest.mark.parametrize("muon_plus,cautious", [(False, False), (True, False), (False, True),
                                                (True, True)])
def test_muon_post_update_matches_reference(muon_plus: bool, cautious: bool) -> None:
    params = [_randn(6, 4, seed=s) for s in (30, 31)]
    grads = [_randn(6, 4, seed=s) for s in (32, 33)]
    orth = _randn(2, 6, 4, seed=34)
    orth_before = orth.clone()
    lr, wd, scale = 0.02, 0.1, 1.5
    expected = []
    for i, p in enumerate(params):
        u = orth[i].double()
        if muon_plus:
            u = ref_muon_plus(u, 1e-8)
        if cautious:
            u = ref_cautious(u, grads[i], True)
        expected.append(p.double() * (1 - lr * wd) - lr * scale * u)
    ops.muon_post_update_(params, orth, grads, lr, wd, scale, muon_plus, 1e-8, cautious, True)
    assert torch.equal(orth, orth_before)
    for p, e in zip(params, expected, strict=True):
        assert _rel(p, e) < 1e-6


@pytest.mark.parametrize("cautious", [False, True])
def test_cautious_adamw_step_matches_float64(cautious: bool) -> None:
    p0 = [_randn(5, 3, seed=40), _randn(7, seed=41)]
    params = [p.clone() for p in p0]
    m = [torch.zeros_like(p) for p in params]
    v = [torch.zeros_like(p) for p in params]
    ref_p = [p.double() for p in p0]
    ref_m = [torch.zeros_like(p) for p in ref_p]
    ref_v = [torch.zeros_like(p) for p in ref_p]
    lr, b1, b2, eps, wd = 1e-2, 0.9, 0.95, 1e-8, 0.1
    for step in (1, 2, 3):
        grads = [_randn(*p.shape, seed=50 + 10 * step + i) for i, p in enumerate(p0)]
        ops.cautious_adamw_step_(params, grads, m, v, lr, b1, b2, eps, wd, step, cautious, True)
        for i, g in enumerate(grads):
            g = g.double()
            ref_m[i] = b1 * ref_m[i] + (1 - b1) * g
            ref_v[i] = b2 * ref_v[i] + (1 - b2) * g * g
            u = (ref_m[i] / (1 - b1 ** step)) / ((ref_v[i] / (1 - b2 ** step)).sqrt() + eps)
            if cautious:
                u = ref_cautious(u, g, True)
            ref_p[i] = ref_p[i] * (1 - lr * wd) - lr * u
    for got, exp in zip(params, ref_p, strict=True):
        assert _rel(got, exp) < 1e-6


def test_ops_trace_under_compile_without_graph_breaks() -> None:
    def step(bufs, grads, params):
        stacked = OPS.muon_pre_orthogonalize_(bufs, grads, 0.95, True, 1e-7, torch.float32)
        orth = OPS.newton_schulz(stacked, 5, list(ops.QUINTIC), 1e-7, torch.float32)
        OPS.muon_post_update_(params, orth, grads, 0.02, 0.1, 1.0, True, 1e-8, True, True)
        return orth

    torch._dynamo.reset()
    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    bufs = [torch.zeros(8, 4) for _ in range(2)]
    grads = [_randn(8, 4, seed=s) for s in (60, 61)]
    params = [_randn(8, 4, seed=s) for s in (62, 63)]
    eager_bufs, eager_params = [b.clone() for b in bufs], [p.clone() for p in params]
    out = compiled(bufs, grads, params)
    ref = step(eager_bufs, grads, eager_params)
    assert torch.allclose(out, ref, atol=1e-6)
    for a, b in zip(params + bufs, eager_params + eager_bufs, strict=True):
        assert torch.allclose(a, b, atol=1e-6)


def test_low_precision_params_are_updated_in_fp32_and_rounded_once():
    """foreach ops round a Python scalar to the tensor dtype (bf16: 1 - 2e-3 -> 0.99609); the
    update must instead be computed in fp32 and rounded once, as the CUDA kernels do."""
    torch.manual_seed(0)
    p32 = torch.randn(8, 16) * 50
    grad32 = torch.randn(8, 16)
    orth = torch.randn(1, 8, 16)
    lr, wd = 0.02, 0.1
    expected = (p32.bfloat16().float() * (1 - lr * wd) - lr * orth[0]).bfloat16()
    p = [p32.bfloat16()]
    ops.muon_post_update_(p, orth, [grad32.bfloat16()], lr, wd, 1.0, False, 1e-8, False, True)
    assert torch.equal(p[0], expected)


def test_adamw_op_accepts_bf16_params_with_fp32_state():
    torch.manual_seed(0)
    p = [torch.randn(5, 7).bfloat16()]
    g = [torch.randn(5, 7).bfloat16()]
    m, v = [torch.zeros(5, 7)], [torch.zeros(5, 7)]
    ref_p = p[0].float().clone()
    ops.cautious_adamw_step_(p, g, m, v, 1e-2, 0.9, 0.95, 1e-8, 0.1, 1, False, True)
    g32 = g[0].float()
    m_ref = 0.1 * g32
    v_ref = 0.05 * g32 * g32
    upd = (m_ref / 0.1) / ((v_ref / 0.05).sqrt() + 1e-8)
    expected = (ref_p * (1 - 1e-2 * 0.1) - 1e-2 * upd).bfloat16()
    assert torch.allclose(m[0], m_ref) and torch.allclose(v[0], v_ref)
    assert torch.equal(p[0], expected)


def test_muon_plus_normalize_returns_contiguous_results_and_its_fake_says_so():
    """The CUDA kernel writes a fresh contiguous tensor; the fake once returned the input's
    strides, so a compiled graph planned a transposed input's result with the wrong ones."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    U = torch.randn(2, 7, 5).mT                                    # (2, 5, 7), transposed
    real = ops.muon_plus_normalize(U)
    with FakeTensorMode() as mode:
        fake = torch.ops.speedtronic.muon_plus_normalize(mode.from_tensor(U))
    assert real.is_contiguous() and fake.stride() == real.stride() == (35, 7, 1)
    torch.testing.assert_close(real, ops.muon_plus_normalize(U.contiguous()))
