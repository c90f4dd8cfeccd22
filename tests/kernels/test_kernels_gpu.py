"""GPU parity of the CUDA kernels against the pure-PyTorch fallback (run by
benchmarks/gpu_check.sh; skipped without a CUDA device and a loaded speedtronic._C).

Every run uses fresh random data (seeded from os.urandom, printed on failure). Outputs the
kernels allocate come from a caching allocator pre-filled with NaN, and a NaN in any output
fails the test, so an element the kernel forgot to write cannot pass."""

from __future__ import annotations

import os

import pytest
import torch
from _emu_fixtures import load_emulator

import speedtronic.kernels.extension as kernels
import speedtronic.kernels.ops as ops

pytestmark = pytest.mark.gpu

SEED = int.from_bytes(os.urandom(4), "little")


def _ready() -> str | None:
    if not torch.cuda.is_available():
        return "no CUDA device"
    st = kernels.status()  # speedtronic.kernels.ops (imported above) has loaded the kernels
    return None if st.active else st.reason


_why_not = _ready() if torch.cuda.is_available() else "no CUDA device"
if _why_not:
    pytestmark = [pytest.mark.gpu, pytest.mark.skip(reason=f"CUDA kernels not active: {_why_not}")]


@pytest.fixture
def gen():
    g = torch.Generator(device="cuda").manual_seed(SEED)
    print(f"seed {SEED}")
    return g


def _poison_allocator(mib: int = 512) -> None:
    """Fill the caching allocator's free blocks with NaN so unwritten outputs show up."""
    torch.cuda.synchronize()
    blk = torch.full((mib * 2**18,), float("nan"), device="cuda")
    del blk
    torch.cuda.synchronize()


def _rand(shape, gen, dtype=torch.float32, scale=1.0):
    return (torch.randn(shape, generator=gen, device="cuda") * scale).to(dtype)


def _close(actual, expected, dtype, what=""):
    assert not actual.isnan().any(), f"{what}: NaN in the kernel's output"
    tol = {torch.float32: (2e-5, 1e-5), torch.bfloat16: (2e-2, 1e-2), torch.float16: (2e-3, 2e-3)}
    rtol, atol_rel = tol[dtype]
    scale = expected.float().abs().max().item() if expected.numel() else 1.0
    torch.testing.assert_close(actual.float(), expected.float(), rtol=rtol,
                               atol=atol_rel * scale + 1e-30,
                               msg=lambda m: f"{what} (seed {SEED}): {m}")


SHAPES = [(1, 67), (45, 1), (37, 45), (300, 7), (129, 257), (768, 3072)]


@pytest.mark.parametrize("dt", [torch.float32, torch.bfloat16, torch.float16])
def test_cautious_mask(gen, dt):
    ups = [_rand(s, gen, dt) for s in SHAPES + [(70000,)]]
    grads = [_rand(u.shape, gen, dt) for u in ups]
    ref = [u.clone() for u in ups]
    _poison_allocator()
    torch.ops.speedtronic.cautious_mask_(ups, grads, True)
    ops._cautious_mask_impl(ref, grads, True)
    for u, r in zip(ups, ref, strict=True):
        _close(u, r, dt, "cautious_mask_")


@pytest.mark.parametrize("cautious", [False, True])
@pytest.mark.parametrize("dt", [torch.float32, torch.bfloat16])
def test_adamw(gen, dt, cautious):
    shapes = SHAPES + [(5,)] * 30
    p = [_rand(s, gen, dt) for s in shapes]
    m = [_rand(s, gen, dt, 0.1) for s in shapes]
    v = [_rand(s, gen, dt, 0.1).square() for s in shapes]
    pr, mr, vr = ([t.clone() for t in ts] for ts in (p, m, v))
    for step in (1, 2):
        g = [_rand(s, gen, dt) for s in shapes]
        _poison_allocator()
        args = (1e-3, 0.9, 0.999, 1e-8, 0.1, step, cautious, True)
        torch.ops.speedtronic.cautious_adamw_step_(p, g, m, v, *args)
        ops._adamw_impl(pr, g, mr, vr, *args)
    for a, b in zip(p + m + v, pr + mr + vr, strict=True):
        _close(a, b, dt, "adamw")


@pytest.mark.parametrize("shape,b", [((768, 768), 4), ((37, 45), 50), ((1, 67), 3)])
@pytest.mark.parametrize("od", [torch.bfloat16, torch.float32])
def test_muon_pre(gen, shape, b, od):
    bufs = [_rand(shape, gen) for _ in range(b)]
    bufs_r = [t.clone() for t in bufs]
    grads = [_rand(shape, gen, torch.bfloat16) for _ in range(b)]
    _poison_allocator()
    out = torch.ops.speedtronic.muon_pre_orthogonalize_(bufs, grads, 0.95, True, 1e-7, od)
    ref = ops._muon_pre_impl(bufs_r, grads, 0.95, True, 1e-7, od)
    _close(out, ref, od, "muon_pre")
    for a, r in zip(bufs, bufs_r, strict=True):
        _close(a, r, torch.float32, "momentum")


def test_lean_passes_match_their_pytorch_bodies(gen):
    """The fused step passes on GPT-2-small-like shapes: a square and a tall matrix in one call
    (the tall one through the tile transpose), 130 matrices (two launch tables)."""
    shapes = [((768, 768), False), ((768, 3072), True)] + [((37, 45), i % 2 == 1)
                                                           for i in range(128)]
    grads = [_rand((n, m) if tall else (m, n), gen) for (m, n), tall in shapes]
    grads = [g.mT if tall else g for g, (_, tall) in zip(grads, shapes, strict=True)]
    mom = [_rand(g.shape, gen) for g in grads]
    mus = [torch.tensor(0.95, device="cuda"), torch.tensor(0.9, device="cuda")]
    args = (mus, [i % 2 for i in range(len(grads))], [int(i % 3 != 0) for i in range(len(grads))],
            [1e-7] * len(grads))
    m_k, m_r = [t.clone() for t in mom], [t.clone() for t in mom]
    _poison_allocator()
    o_k = [torch.empty(g.shape, device="cuda", dtype=torch.float16) for g in grads]
    o_r = [torch.empty_like(o) for o in o_k]
    torch.ops.speedtronic.muon_lean_pre_(grads, m_k, o_k, [], *args)
    ops._lean_pre_impl(grads, m_r, o_r, [], *args)
    for a, r, b, q in zip(o_k, o_r, m_k, m_r, strict=True):
        _close(a, r, torch.float16, "lean pre")
        _close(b, q, torch.float32, "lean momentum")
    params = [_rand(g.shape[::-1] if g.stride(0) == 1 else g.shape, gen) for g in grads]
    updates = [o.mT if p.shape != o.shape else o for p, o in zip(params, o_k, strict=True)]
    ref = [p.clone() for p in params]
    skip = torch.tensor([False, True], device="cuda")
    lrs, wds = [torch.tensor(0.02, device="cuda")], [torch.tensor(0.1, device="cuda")]
    uargs = (lrs, wds, [0] * len(params), [1.5] * len(params), skip,
             [i % 3 - 1 for i in range(len(params))])
    torch.ops.speedtronic.muon_lean_update_(params, updates, *uargs, [], [], [], None, [])
    ops._lean_update_impl(ref, updates, *uargs, [], [], [], None, [])
    for a, r in zip(params, ref, strict=True):
        _close(a, r, torch.float32, "lean update")
    # Muon+ folded into the update: the stats op on the logical views, then the scaled update
    logical = [u.mT if i % 2 else u for i, u in enumerate(updates)]
    rows_k = [torch.empty(v.shape[0], device="cuda") for v in logical]
    cols_k = [torch.empty(v.shape[1], device="cuda") for v in logical]
    rows_r, cols_r = [torch.empty_like(t) for t in rows_k], [torch.empty_like(t) for t in cols_k]
    eps = [1e-8] * len(logical)
    torch.ops.speedtronic.muon_lean_plus_stats_(logical, rows_k, cols_k, eps)
    ops._lean_plus_stats_impl(logical, rows_r, cols_r, eps)
    for a, r in zip(rows_k + cols_k, rows_r + cols_r, strict=True):
        _close(a, r, torch.float32, "lean plus stats")
    rs = [c if i % 2 else r for i, (r, c) in enumerate(zip(rows_k, cols_k, strict=True))]
    cs = [r if i % 2 else c for i, (r, c) in enumerate(zip(rows_k, cols_k, strict=True))]
    ref = [p.clone() for p in params]
    # and the cautious mask: counts, then the masked, rescaled update (gradients laid out like
    # the updates)
    grads32 = [torch.randn(u.shape[::-1] if u.stride(0) == 1 else u.shape, device="cuda",
                           generator=gen) for u in updates]
    grads32 = [g.mT if u.stride(0) == 1 else g for g, u in zip(grads32, updates, strict=True)]
    kept_k = torch.empty(len(updates), dtype=torch.int64, device="cuda")
    kept_r = torch.empty_like(kept_k)
    torch.ops.speedtronic.muon_lean_cautious_count_(updates, grads32, kept_k)
    ops._lean_cautious_count_impl(updates, grads32, kept_r)
    assert torch.equal(kept_k, kept_r), (kept_k, kept_r)
    kept_index = [i if i % 2 else -1 for i in range(len(updates))]
    ref = [p.clone() for p in params]
    torch.ops.speedtronic.muon_lean_update_(params, updates, *uargs, rs, cs, grads32, kept_k,
                                            kept_index)
    ops._lean_update_impl(ref, updates, *uargs, rs, cs, grads32, kept_k, kept_index)
    for a, r in zip(params, ref, strict=True):
        _close(a, r, torch.float32, "lean update with Muon+ scales and the cautious mask")


@pytest.mark.parametrize("shape", [(1, 67), (45, 1), (4, 37, 45), (2, 3072, 768)])
@pytest.mark.parametrize("dt", [torch.float32, torch.bfloat16])
def test_muon_plus_normalize(gen, shape, dt):
    U = _rand(shape, gen, dt)
    _poison_allocator()
    out = torch.ops.speedtronic.muon_plus_normalize(U, 1e-8)
    _close(out, ops._muon_plus_impl(U, 1e-8), dt, "muon+")


@pytest.mark.parametrize("muon_plus,cautious", [(False, False), (True, False), (True, True)])
def test_muon_post(gen, muon_plus, cautious):
    for shape, b, pd in [((768, 3072), 3, torch.float32), ((300, 7), 5, torch.bfloat16)]:
        params = [_rand(shape, gen, pd) for _ in range(b)]
        ref = [p.clone() for p in params]
        grads = [_rand(shape, gen, pd) for _ in range(b)]
        orth = _rand((b, *shape), gen, torch.bfloat16)
        _poison_allocator()
        args = (0.02, 0.1, 2.0, muon_plus, 1e-8, cautious, True)
        torch.ops.speedtronic.muon_post_update_(params, orth, grads, *args)
        ops._muon_post_impl(ref, orth, grads, *args)
        for a, r in zip(params, ref, strict=True):
            _close(a, r, pd, f"muon_post {shape}")


@pytest.mark.parametrize("m,k", [(1, 5), (33, 40), (130, 72), (768, 3072), (1000, 1000)])
def test_symmetric_kernel(gen, m, k):
    X = _rand((3, m, k), gen, torch.bfloat16)
    _poison_allocator()
    out = torch.ops.speedtronic_debug.syrk(X, 1.0, 0.0, None)
    ref = torch.bmm(X.float(), X.float().mT)
    assert torch.equal(out, out.mT)
    _close(out, ref, torch.bfloat16, "syrk")
    out2 = torch.ops.speedtronic_debug.syrk(out, 2.0315, -4.775, out)  # b A + c A A
    ref2 = -4.775 * out.float() + 2.0315 * torch.bmm(out.float(), out.float())
    _close(out2, ref2, torch.bfloat16, "syrk fused")


def _hopper() -> bool:
    return torch.cuda.get_device_capability() == (9, 0)


@pytest.mark.parametrize("b,m,k", [(1, 1, 8), (7, 37, 40), (3, 130, 72), (2, 200, 328),
                                   (1, 768, 3072), (2, 1000, 1000), (1, 2048, 520)])
def test_hopper_sym_gemm(gen, b, m, k):
    """The sm_90a TMA + wgmma kernel against fp32 math on fresh data, both tile shapes."""
    if not _hopper():
        pytest.skip("the TMA + wgmma kernel needs an sm_90 GPU")
    dbg = torch.ops.speedtronic_debug
    for dt in (torch.bfloat16, torch.float16):
        X = _rand((b, m, k), gen, dt, scale=k ** -0.5)
        for tile_n in (128, 256):
            _poison_allocator()
            out = dbg.sym_gemm(X, 1.0, 0.0, None, tile_n)
            torch.cuda.synchronize()
            assert torch.equal(out, out.mT), f"{dt} tile {tile_n}: not exactly symmetric"
            _close(out, torch.bmm(X.float(), X.float().mT), dt, f"sym_gemm {dt} tile {tile_n}")
            A = (out.float() / out.float().abs().amax()).to(dt)
            poly = dbg.sym_gemm(A, 2.0315, -4.775, A, tile_n)  # b A + c A A
            ref = -4.775 * A.float() + 2.0315 * torch.bmm(A.float(), A.float())
            assert torch.equal(poly, poly.mT)
            _close(poly, ref, dt, f"sym_gemm poly {dt} tile {tile_n}")


def test_hopper_sym_gemm_matches_the_emulation(gen):
    """The same input through the GPU kernel and its CPU emulation (same source)."""
    if not _hopper():
        pytest.skip("the TMA + wgmma kernel needs an sm_90 GPU")
    X = _rand((2, 150, 96), gen, torch.bfloat16)
    hw = torch.ops.speedtronic_debug.sym_gemm(X, 1.0, 0.0, None, 0)
    try:
        emu = load_emulator()
    except Exception as exc:  # noqa: BLE001 - no g++ on the GPU image: say so
        pytest.skip(f"emulation not buildable here: {exc}")
    emulated = emu.sym_gemm(X.cpu(), 1.0, 0.0, None, 0)
    _close(hw.cpu(), emulated, torch.bfloat16, "hardware vs emulation")


@pytest.mark.parametrize("b,m", [(1, 1), (7, 37), (3, 130), (2, 768), (1, 2048)])
def test_poly_lt_matches_baddbmm_and_leaves_a_untouched(gen, b, m):
    """cuBLASLt with C != D: b A + c A A as torch.baddbmm computes it, A not written."""
    dbg = torch.ops.speedtronic_debug
    assert dbg.cublaslt_status() == "ok"
    for dt in (torch.float16, torch.bfloat16):
        X = _rand((b, m, 2 * m), gen, dt, scale=(2 * m) ** -0.5)
        A = torch.bmm(X, X.mT)
        before = A.clone()
        _poison_allocator()
        out = dbg.poly_lt(A, -4.775, 2.0315)
        torch.cuda.synchronize()
        assert torch.equal(A, before), "poly_lt wrote into A"
        ref = torch.baddbmm(A.float(), A.float(), A.float(), beta=-4.775, alpha=2.0315)
        _close(out, ref, dt, f"poly_lt {dt}")


@pytest.mark.parametrize("b,m,n", [(1, 1, 1), (7, 37, 45), (3, 130, 130), (2, 768, 3072),
                                   (48, 768, 768)])
def test_ns_step_lt_is_one_iteration_and_leaves_its_inputs_untouched(gen, b, m, n):
    """cuBLASLt with C != D, twice: a X + (b A + c A A) X for A = X X^T, X and A not written."""
    dbg = torch.ops.speedtronic_debug
    for dt in (torch.float16, torch.bfloat16):
        X = _rand((b, m, n), gen, dt, scale=(m * n) ** -0.5)
        A = torch.bmm(X, X.mT)
        before_x, before_a = X.clone(), A.clone()
        _poison_allocator()
        out = dbg.ns_step_lt(X, A, 3.4445, -4.775, 2.0315)
        torch.cuda.synchronize()
        assert torch.equal(X, before_x) and torch.equal(A, before_a), "ns_step_lt wrote an input"
        Af, Xf = A.float(), X.float()
        ref = 3.4445 * Xf + (-4.775 * Af + 2.0315 * Af @ Af) @ Xf
        _close(out, ref, dt, f"ns_step_lt {dt}")


@pytest.mark.parametrize("shape", [(768, 3072), (3072, 768), (4, 1024, 1024), (2, 512, 2048)])
def test_newton_schulz_on_cuda_every_method_against_float64(gen, shape):
    """NS on CUDA is cuBLAS driven by the same Python body as on the CPU: fp16 (the auto dtype)
    with either iteration must beat bf16 standard NS (what torch computes) against float64."""
    G = _rand(shape, gen)
    ref64 = ops.newton_schulz(G.double(), 5, list(ops.QUINTIC), 1e-7, torch.float64, "standard")
    errs = {}
    for name, dtype, method in (("fp16_standard", torch.float16, "standard"),
                                ("fp16_gram", torch.float16, "gram"),
                                ("fp16_auto", None, "auto"),
                                ("bf16_standard", torch.bfloat16, "standard")):
        out = ops.newton_schulz(G, 5, list(ops.QUINTIC), 1e-7, dtype, method)
        assert out.shape == G.shape and torch.isfinite(out).all(), name
        errs[name] = ((out.double() - ref64).norm() / ref64.norm()).item()
    for name in ("fp16_standard", "fp16_gram", "fp16_auto"):
        assert errs[name] < errs["bf16_standard"], errs


@pytest.mark.parametrize("schedule", ["quintic", "polar_express"])
@pytest.mark.parametrize("shape", [(4, 768, 768), (2, 768, 3072)])
def test_the_copy_free_fold_is_as_accurate_as_the_old_route_on_cuda(gen, monkeypatch, schedule,
                                                                    shape):
    """a I + b A + c A^2 as ``A + (a/b) I`` then an in-place baddbmm_
    (newton_schulz_gemm._fold_poly) against the route it replaced (baddbmm's copy, then a
    diagonal add), fp16 on cuBLAS: the CPU emulation (benchmarks/results/fold_rounding.md)
    predicts 0.66-1.01x the error."""
    from speedtronic.kernels import newton_schulz as ns

    def old_route(A, a, b, c, out=None):
        P = torch.baddbmm(A, A, A, beta=b, alpha=c, out=out)
        P.diagonal(dim1=-2, dim2=-1).add_(a)
        return P

    G = _rand(shape, gen)
    coeffs = ops.resolve_coefficients(schedule, 5)
    ref64 = ops.newton_schulz(G.double(), 5, coeffs, 1e-7, torch.float64, "standard")
    errs = {}
    for route in ("new", "old"):
        if route == "old":
            monkeypatch.setattr(ns, "_fold_poly", old_route)
        for method in ("standard", "gram"):
            out = ops.newton_schulz(G, 5, coeffs, 1e-7, torch.float16, method)
            errs[route, method] = ((out.double() - ref64).norm() / ref64.norm()).item()
    for method in ("standard", "gram"):
        assert errs["new", method] <= 1.25 * errs["old", method], errs


def test_muon_fp64_and_fp16_run_on_cuda(gen):
    """The H200 run found ns_dtype="fp64" raising on CUDA: dtypes the kernels lack must take the
    PyTorch path of that op automatically."""
    from speedtronic.optim import Muon

    for ns_dtype in ("fp64", "fp16", "auto"):
        w = torch.nn.Parameter(_rand((256, 512), gen))
        w.grad = _rand((256, 512), gen)
        before = w.detach().clone()
        Muon([w], lr=0.02, ns_dtype=ns_dtype).step()
        assert torch.isfinite(w).all() and not torch.equal(w, before), ns_dtype


def test_mma_layout_matches_hardware_and_emulation(gen):
    for dt in (torch.bfloat16, torch.float16):
        A = _rand((16, 16), gen, dt)
        Bt = _rand((8, 16), gen, dt)
        hw = torch.ops.speedtronic_debug.mma_probe(A, Bt)
        torch.testing.assert_close(hw, A.float() @ Bt.float().T, rtol=1e-3, atol=1e-3)
        try:
            emu = load_emulator()
        except Exception as exc:  # noqa: BLE001 - no g++ on the GPU image: say so
            pytest.skip(f"emulation not buildable here: {exc}")
        emulated = emu.mma_probe(A.cpu(), Bt.cpu())
        torch.testing.assert_close(emulated, hw.cpu(), rtol=1e-5, atol=1e-5)


def test_full_step_captures_in_a_cuda_graph(gen):
    shapes = [(768, 768)] * 4 + [(768, 3072)]
    params = [_rand(s, gen) for s in shapes]
    grads = [_rand(s, gen) for s in shapes]
    bufs = [torch.zeros_like(p) for p in params]

    def step():
        groups: dict = {}
        for i, p in enumerate(params):
            groups.setdefault(tuple(p.shape), []).append(i)
        sp = torch.ops.speedtronic
        for idx in groups.values():
            p, g, b = ([ts[i] for i in idx] for ts in (params, grads, bufs))
            x = sp.muon_pre_orthogonalize_(b, g, 0.95, True, 1e-7, torch.float16)
            orth = sp.newton_schulz(x, 5, list(ops.QUINTIC), 1e-7, torch.float16, "auto", True)
            sp.muon_post_update_(p, orth, g, 0.02, 0.01, 1.0, True, 1e-8, True, True)

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(s)
    snapshot = [p.clone() for p in params] + [b.clone() for b in bufs]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for t, v in zip(params + bufs, snapshot, strict=True):
        t.copy_(v)
    graph.replay()
    replayed = [p.clone() for p in params]
    for t, v in zip(params + bufs, snapshot, strict=True):
        t.copy_(v)
    step()
    for a, b in zip(replayed, params, strict=True):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("mode,kw", [(True, {}), ("auto", {}),
                                     (True, {"muon_plus": True, "cautious": True})])
def test_muon_cuda_graph_option_matches_eager_under_a_schedule(gen, mode, kw, caplog):
    """Muon(cuda_graph=True): warm-up, capture, replay with new gradient tensors each step and
    an LR schedule filling the lr tensor, equal to the eager step throughout. ``"auto"`` also
    times both and logs its choice (whichever it keeps, the updates are the eager ones). With
    Muon+ and the cautious mask the captured step holds their statistics and counts too."""
    from speedtronic.optim import Muon

    caplog.set_level("INFO", logger="speedtronic.optim")
    shapes = [(768, 768)] * 4 + [(768, 3072), (3072, 768)]
    init = [_rand(s, gen) for s in shapes]
    grads = [[_rand(s, gen) for s in shapes] for _ in range(12)]
    runs = []
    for graphed in (False, mode):
        params = [torch.nn.Parameter(w.clone()) for w in init]
        opt = Muon(params, lr=0.02, weight_decay=0.01, cuda_graph=graphed, **kw)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))
        for step_grads in grads:
            for p, g in zip(params, step_grads, strict=True):
                p.grad = g.clone()
            opt.step()
            sched.step()
        assert (opt.__dict__.get("_muon_graph") is not None) == bool(graphed)
        if graphed is True:
            assert opt._muon_graph.graph is not None
        elif graphed == "auto":
            assert "muon cuda graph: auto -> " in caplog.text
        runs.append([p.detach().clone() for p in params])
    for a, b in zip(*runs, strict=True):
        torch.testing.assert_close(a, b, rtol=2e-3, atol=2e-5)


@pytest.mark.parametrize("kw", [{}, {"muon_plus": True}, {"cautious": True},
                                {"muon_plus": True, "cautious": True},
                                {"cautious": True, "cautious_rescale": False}])
def test_the_fused_step_matches_the_torch_route_on_cuda(gen, monkeypatch, kw):
    """The whole Muon step on the extension's fused passes (muon_fused: pre-pass, Muon+
    statistics, cautious counts, one update applying both) against the batched torch route on
    the same GPU, GPT-2-like shapes with a tall part in a mixed group, fp16 Newton-Schulz."""
    from speedtronic.optim import Muon, muon_step

    shapes = [(768, 768)] * 3 + [(768, 3072), (3072, 768), (37, 45)]
    init = [_rand(s, gen) for s in shapes]
    grads = [[_rand(s, gen) for s in shapes] for _ in range(3)]
    runs = {}
    real = muon_step._fused_passes
    for route in ("torch", "fused"):
        monkeypatch.setattr(muon_step, "_fused_passes",
                            lambda cache, r=route: r == "fused" and real(cache))
        params = [torch.nn.Parameter(w.clone()) for w in init]
        opt = Muon(params, lr=0.02, weight_decay=0.01, ns_dtype="fp16", **kw)
        for step_grads in grads:
            for p, g in zip(params, step_grads, strict=True):
                p.grad = g.clone()
            opt.step()
        torch.cuda.synchronize()
        runs[route] = [p.detach().clone() for p in params]
    assert real(opt.muon_cache), "the fused route is not taken on this GPU"
    for a, b in zip(runs["fused"], runs["torch"], strict=True):
        _close(a, b, torch.float16, f"fused step {kw}")
