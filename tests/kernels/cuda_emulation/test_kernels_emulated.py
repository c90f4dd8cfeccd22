"""The real CUDA kernel sources (csrc/) run on the CPU through cuda_emulation/stemu.h and
are compared with the pure-PyTorch ops of kernels.ops, under the forward, reverse and random
thread schedules. The emulated library is built once per source change (cached, ~1 min)."""

from __future__ import annotations

import pytest
import torch
from _emu_fixtures import load_emulator

import speedtronic.kernels.ops as ops

SCHEDULES = ("forward", "reverse", "random")
CHUNK = 16384  # st::kChunk: elements per block in the multi-tensor kernels
MAX_TENSORS = 24  # st::kMaxTensors: tensors per launch table
MAX_MATS = 48  # st::kMaxMats: matrices per Muon launch


@pytest.fixture(scope="session")
def emu():
    return load_emulator()


@pytest.fixture(params=SCHEDULES)
def sched(request, emu):
    emu.configure(request.param, 1234)
    return request.param


def _close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype,
           what: str = "") -> None:
    """fp32: within a few ulps. 16-bit: within about one rounding of the tensor's scale (the
    reference rounds at every foreach op, and on CPU torch._foreach_mul_ rounds its scalar to
    bf16, e.g. 0.998 -> 0.996, where the kernels keep the scalar in fp32)."""
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} vs {expected.shape}"
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} vs {expected.dtype}"
    assert not actual.isnan().any() or expected.isnan().any(), f"{what}: NaN from the kernel"
    tol = {torch.float32: (2e-6, 1e-6), torch.bfloat16: (2e-2, 1e-2), torch.float16: (2e-3, 2e-3)}
    rtol, atol_rel = tol[dtype]
    finite = expected[expected.isfinite()]
    scale = finite.abs().max().item() if finite.numel() else 1.0
    torch.testing.assert_close(actual.float(), expected.float(), rtol=rtol,
                               atol=atol_rel * scale + 1e-30, msg=lambda m: f"{what}: {m}")


def _awkward_shapes():
    # 1xn, nx1, not multiples of 16/32, crossing one and two chunk boundaries, empty
    return [(1, 67), (45, 1), (37, 5), (CHUNK + 3,), (2 * CHUNK + 17,), (0,), (3, 0)]


# ------------------------------------------------------------------------------ cautious_mask_
@pytest.mark.parametrize("rescale", [True, False])
def test_cautious_mask_matches_reference(emu, sched, rescale):
    gen = torch.Generator().manual_seed(1)
    dtypes = [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
              (torch.float16, torch.float32), (torch.float32, torch.bfloat16)]
    for ud, gd in dtypes:
        ups = [torch.randn(s, generator=gen).to(ud) for s in _awkward_shapes()]
        grads = [torch.randn(s, generator=gen).to(gd) for s in _awkward_shapes()]
        grads[2].zero_()  # all-masked tensor: kept = 0
        ref = [u.clone() for u in ups]
        emu.cautious_mask_(ups, grads, rescale)
        ops.cautious_mask_(ref, grads, rescale)
        for i, (a, b) in enumerate(zip(ups, ref, strict=True)):
            _close(a, b, ud, f"{ud}/{gd} tensor {i}")


def test_cautious_mask_many_tensors_and_magnitudes(emu, sched):
    # More tensors than one launch table holds; huge and tiny magnitudes; an empty list.
    gen = torch.Generator().manual_seed(2)
    n = 2 * MAX_TENSORS + 5
    ups = [torch.randn(3 + i, generator=gen) * (1e30 if i % 3 == 0 else 1e-30) for i in range(n)]
    grads = [torch.randn(3 + i, generator=gen) * (1e-20 if i % 2 else 1e20) for i in range(n)]
    ref = [u.clone() for u in ups]
    emu.cautious_mask_(ups, grads, True)
    ops.cautious_mask_(ref, grads, True)
    for a, b in zip(ups, ref, strict=True):
        _close(a, b, torch.float32)
    emu.cautious_mask_([], [], True)  # no-op, no error


def test_cautious_mask_non_contiguous_update_written_back(emu):
    emu.configure("forward", 0)
    base = torch.randn(8, 6)
    u = base.t()  # non-contiguous view: the kernel works on a copy and writes it back
    g = torch.randn(6, 8)
    ref = u.clone()
    emu.cautious_mask_([u], [g], False)
    ops.cautious_mask_([ref], [g], False)
    _close(base.t(), ref, torch.float32)


def test_cautious_mask_rejects_mismatch(emu):
    with pytest.raises(ValueError, match="grads"):
        emu.cautious_mask_([torch.zeros(3)], [], True)
    with pytest.raises(ValueError, match="elements"):
        emu.cautious_mask_([torch.zeros(3)], [torch.zeros(4)], True)
    # as many elements, another shape: was paired by flat index (the PyTorch body refuses it)
    with pytest.raises(ValueError, match=r"grads\[0\] has shape \[6, 4\], expected \[4, 6\]"):
        emu.cautious_mask_([torch.zeros(4, 6)], [torch.zeros(6, 4)], True)
    with pytest.raises(ValueError, match="shape"):
        emu.cautious_adamw_step_([torch.zeros(4, 6)], [torch.zeros(6, 4)], [torch.zeros(4, 6)],
                                 [torch.zeros(4, 6)], 1e-3, 0.9, 0.95, 1e-8, 0.0, 1, False, True)
    with pytest.raises(ValueError, match="Double"):
        emu.cautious_mask_([torch.zeros(3, dtype=torch.float64)], [torch.zeros(3)], True)


# ------------------------------------------------------------------------------ AdamW
@pytest.mark.parametrize("cautious,rescale", [(False, False), (True, False), (True, True)])
def test_adamw_matches_reference(emu, sched, cautious, rescale):
    gen = torch.Generator().manual_seed(3)
    shapes = [(1, 67), (45, 1), (37, 5), (CHUNK + 3,), (0,)] + [(7,)] * (MAX_TENSORS + 2)
    # (The reference cannot mix a bf16 param with fp32 state: torch lerp needs one dtype.)
    for pd, sd in [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                   (torch.float16, torch.float16)]:
        params = [torch.randn(s, generator=gen).to(pd) for s in shapes]
        m = [torch.randn(s, generator=gen).to(sd) * 0.1 for s in shapes]
        v = [torch.rand(s, generator=gen).to(sd) * 0.01 for s in shapes]
        params_r, m_r, v_r = ([t.clone() for t in ts] for ts in (params, m, v))
        for step in (1, 2, 7):
            grads = [torch.randn(s, generator=gen).to(pd) for s in shapes]
            grads[2].zero_()
            args = (1e-2, 0.9, 0.999, 1e-8, 0.1, step, cautious, rescale)
            emu.cautious_adamw_step_(params, grads, m, v, *args)
            ops.cautious_adamw_step_(params_r, grads, m_r, v_r, *args)
        for i in range(len(shapes)):
            what = f"{pd}/{sd} tensor {i}"
            _close(m[i], m_r[i], sd, "exp_avg " + what)
            _close(v[i], v_r[i], sd, "exp_avg_sq " + what)
            _close(params[i], params_r[i], pd, "param " + what)


@pytest.mark.parametrize("pd,gd", [(torch.float16, torch.float16),
                                   (torch.bfloat16, torch.bfloat16),
                                   (torch.bfloat16, torch.float32)])
def test_adamw_from_zero_moments_matches_the_reference_and_stays_finite(emu, pd, gd):
    """Fresh state (v = 0), zero and tiny gradients: the kernel rounded its direction to the
    state dtype, where eps = 1e-8 is 0 in fp16, so 1/0 * m made a whole fp16 model NaN or inf
    after one step while the reference stayed finite. A gradient in another dtype than the
    state is rounded to it first, as the reference does."""
    gen = torch.Generator().manual_seed(4)
    p = torch.randn(300, generator=gen).to(pd)
    g = (torch.randn(300, generator=gen) * 1e-3).to(gd)
    g[:50] = 0
    m, v = torch.zeros(300, dtype=pd), torch.zeros(300, dtype=pd)
    pr, mr, vr = p.clone(), m.clone(), v.clone()
    for cautious in (False, True):
        for step in (1, 2):
            args = (1e-3, 0.9, 0.999, 1e-8, 0.0, step, cautious, True)
            emu.cautious_adamw_step_([p], [g], [m], [v], *args)
            ops.cautious_adamw_step_([pr], [g], [mr], [vr], *args)
            assert torch.isfinite(p).all() and torch.isfinite(m).all()
            _close(p, pr, pd, f"param {pd}/{gd} step {step}")
            _close(m, mr, pd, "exp_avg")
            _close(v, vr, pd, "exp_avg_sq")


def test_adamw_zero_weight_decay_and_errors(emu):
    emu.configure("forward", 0)
    p, g = torch.randn(40), torch.randn(40)
    m, v = torch.zeros(40), torch.zeros(40)
    pr, mr, vr = p.clone(), m.clone(), v.clone()
    emu.cautious_adamw_step_([p], [g], [m], [v], 1e-3, 0.9, 0.95, 1e-8, 0.0, 1, False, True)
    ops.cautious_adamw_step_([pr], [g], [mr], [vr], 1e-3, 0.9, 0.95, 1e-8, 0.0, 1, False, True)
    _close(p, pr, torch.float32)
    with pytest.raises(ValueError, match="step must be >= 1"):
        emu.cautious_adamw_step_([p], [g], [m], [v], 1e-3, 0.9, 0.95, 1e-8, 0.0, 0, False, True)
    with pytest.raises(ValueError, match="same length"):
        emu.cautious_adamw_step_([p], [], [m], [v], 1e-3, 0.9, 0.95, 1e-8, 0.0, 1, False, True)
    emu.cautious_adamw_step_([], [], [], [], 1e-3, 0.9, 0.95, 1e-8, 0.0, 1, True, True)


# ------------------------------------------------------------------------------ Muon pre
@pytest.mark.parametrize("shape,b", [((1, 67), 3), ((45, 1), 2), ((129, 257), 2),
                                     ((5, 7), MAX_MATS + 3)])
def test_muon_pre_matches_reference(emu, sched, shape, b):
    gen = torch.Generator().manual_seed(4)
    for gd, od, nesterov in [(torch.float32, torch.float32, True),
                             (torch.bfloat16, torch.bfloat16, True),
                             (torch.float32, torch.float16, False)]:
        bufs = [torch.randn(shape, generator=gen) for _ in range(b)]
        bufs_r = [t.clone() for t in bufs]
        grads = [torch.randn(shape, generator=gen).to(gd) for _ in range(b)]
        grads[0].zero_()
        bufs[0].zero_()
        bufs_r[0].zero_()  # an all-zero matrix: its update must stay exactly zero
        out = emu.muon_pre_orthogonalize_(bufs, grads, 0.95, nesterov, 1e-7, od)
        ref = ops.muon_pre_orthogonalize_(bufs_r, grads, 0.95, nesterov, 1e-7, od)
        _close(out, ref, od, f"{gd}->{od}")
        assert torch.equal(out[0], torch.zeros_like(out[0]))
        for a, r in zip(bufs, bufs_r, strict=True):
            _close(a, r, torch.float32, "momentum")


def test_muon_pre_huge_and_tiny(emu):
    emu.configure("random", 7)
    for scale in (1e30, 1e-30):
        bufs = [torch.zeros(9, 33), torch.zeros(9, 33)]
        bufs_r = [t.clone() for t in bufs]
        grads = [torch.randn(9, 33) * scale for _ in range(2)]
        out = emu.muon_pre_orthogonalize_(bufs, grads, 0.9, True, 1e-7, torch.float32)
        ref = ops.muon_pre_orthogonalize_(bufs_r, grads, 0.9, True, 1e-7, torch.float32)
        assert out.isfinite().all() == ref.isfinite().all()
        if ref.isfinite().all():
            _close(out, ref, torch.float32, f"scale {scale}")


def test_muon_pre_rejects_bad_input(emu):
    with pytest.raises(ValueError, match="float32"):
        emu.muon_pre_orthogonalize_([torch.zeros(2, 2, dtype=torch.bfloat16)], [torch.zeros(2, 2)],
                                    0.9, True, 1e-7, torch.float32)
    with pytest.raises(ValueError, match="one shape"):
        two = [torch.zeros(2, 2), torch.zeros(2, 3)]
        emu.muon_pre_orthogonalize_(two, two, 0.9, True, 1e-7, torch.float32)
    with pytest.raises(ValueError, match="at least one"):
        emu.muon_pre_orthogonalize_([], [], 0.9, True, 1e-7, torch.float32)


# ------------------------------------------------------------------------------ Muon+
@pytest.mark.parametrize("shape", [(1, 67), (45, 1), (2, 37, 45), (2, 300, 7), (3, 0, 4)])
def test_muon_plus_normalize_matches_reference(emu, sched, shape):
    gen = torch.Generator().manual_seed(5)
    for dt in (torch.float32, torch.bfloat16, torch.float16):
        U = torch.randn(shape, generator=gen).to(dt)
        if U.numel():
            U.view(-1, U.shape[-1])[0].zero_()  # a zero row stays finite (eps)
        _close(emu.muon_plus_normalize(U, 1e-8), ops.muon_plus_normalize(U, 1e-8), dt, str(dt))


def test_muon_plus_normalize_float64_and_errors(emu):
    U = torch.randn(5, 9, dtype=torch.float64)
    torch.testing.assert_close(emu.muon_plus_normalize(U, 1e-8), ops.muon_plus_normalize(U, 1e-8))
    with pytest.raises(ValueError, match="floating"):
        emu.muon_plus_normalize(torch.zeros(4), 1e-8)


# ------------------------------------------------------------------------------ Muon post
@pytest.mark.parametrize("muon_plus,cautious,rescale", [(False, False, False), (True, False, False),
                                                        (False, True, True), (True, True, True),
                                                        (True, True, False)])
def test_muon_post_matches_reference(emu, sched, muon_plus, cautious, rescale):
    gen = torch.Generator().manual_seed(6)
    for shape, b in [((37, 45), 3), ((1, 67), 2), ((300, 7), 2), ((129, 257), 1)]:
        for pd, od in [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                       (torch.float32, torch.bfloat16)]:
            params = [torch.randn(shape, generator=gen).to(pd) for _ in range(b)]
            ref = [p.clone() for p in params]
            grads = [torch.randn(shape, generator=gen).to(pd) for _ in range(b)]
            orth = torch.randn((b, *shape), generator=gen).to(od)
            args = (0.02, 0.1, 1.5, muon_plus, 1e-8, cautious, rescale)
            emu.muon_post_update_(params, orth, grads, *args)
            ops.muon_post_update_(ref, orth, grads, *args)
            for i in range(b):
                _close(params[i], ref[i], pd, f"{shape} {pd}/{od} matrix {i}")


def test_muon_post_many_matrices_and_errors(emu):
    emu.configure("reverse", 0)
    b = MAX_MATS + 2
    params = [torch.randn(3, 5) for _ in range(b)]
    ref = [p.clone() for p in params]
    grads = [torch.randn(3, 5) for _ in range(b)]
    orth = torch.randn(b, 3, 5)
    emu.muon_post_update_(params, orth, grads, 0.1, 0.0, 1.0, True, 1e-8, True, True)
    ops.muon_post_update_(ref, orth, grads, 0.1, 0.0, 1.0, True, 1e-8, True, True)
    for a, r in zip(params, ref, strict=True):
        _close(a, r, torch.float32)
    with pytest.raises(ValueError, match="orthogonalized"):
        emu.muon_post_update_(params, orth[:2], grads, 0.1, 0.0, 1.0, False, 1e-8, False, False)


# ------------------------------------------------------------------------------ tensor cores
@pytest.mark.parametrize("dt", [torch.bfloat16, torch.float16])
def test_mma_fragment_layout(emu, sched, dt):
    gen = torch.Generator().manual_seed(7)
    A = torch.randn(16, 16, generator=gen).to(dt)
    Bt = torch.randn(8, 16, generator=gen).to(dt)
    D = emu.mma_probe(A, Bt)
    torch.testing.assert_close(D, A.float() @ Bt.float().T, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("m,k", [(1, 5), (7, 16), (33, 40), (130, 72), (129, 33)])
def test_symmetric_kernel(emu, sched, m, k):
    gen = torch.Generator().manual_seed(8)
    for dt in (torch.bfloat16, torch.float16):
        X = torch.randn(2, m, k, generator=gen).to(dt)
        ref = X.float() @ X.float().mT
        out = emu.syrk(X, 1.0, 0.0, None)
        assert torch.equal(out, out.mT), "mirrored tiles must make the result exactly symmetric"
        tol = 1e-2 if dt == torch.bfloat16 else 2e-3
        torch.testing.assert_close(out.float(), ref, rtol=tol, atol=tol * ref.abs().max().item())
        # fused polynomial: beta * Y + alpha * X X^T with one rounding
        Y = out
        out2 = emu.syrk(X, -0.5, 2.0, Y)
        ref2 = 2.0 * Y.float() - 0.5 * ref
        torch.testing.assert_close(out2.float(), ref2, rtol=tol, atol=tol * ref2.abs().max().item())


def test_symmetric_kernel_strided_input(emu):
    emu.configure("forward", 0)
    X = torch.randn(40, 24).to(torch.bfloat16)[:, 3:20]  # row stride 24, k = 17: scalar loads
    out = emu.syrk(X, 1.0, 0.0, None)
    ref = X.float() @ X.float().T
    torch.testing.assert_close(out.float(), ref, rtol=1e-2, atol=1e-2 * ref.abs().max().item())


# ------------------------------------------------------------------------------ the emulator
def test_emulator_reports_kernel_bugs(emu):
    emu.configure("forward", 0)
    with pytest.raises(RuntimeError, match="__syncthreads"):
        emu.run_bug("divergent_barrier")
    with pytest.raises(RuntimeError, match="did not take part"):
        emu.run_bug("shuffle_after_exit")
    with pytest.raises(RuntimeError, match="deadlock"):
        emu.run_bug("deadlock")
    # A missing barrier reads poisoned shared memory under at least one schedule.
    poisoned = False
    for s in SCHEDULES:
        emu.configure(s, 3)
        poisoned |= bool(emu.run_bug("missing_barrier").isnan().any())
    assert poisoned


def test_emulated_schemas_match_the_op_registry(emu):
    from speedtronic.kernels.ops import CUDA_KERNEL_OPS

    for name in CUDA_KERNEL_OPS:
        ours = getattr(torch.ops.speedtronic, name).default._schema
        emulated = getattr(emu, name).default._schema
        assert [(a.name, str(a.type), a.default_value) for a in ours.arguments] == \
               [(a.name, str(a.type), a.default_value) for a in emulated.arguments], name
        assert [str(r.type) for r in ours.returns] == [str(r.type) for r in emulated.returns]


def test_launch_count_depends_on_shape_groups_not_parameter_count(emu):
    """Issue target: launches per step grow with distinct shapes, not with the parameter count."""
    emu.configure("forward", 0)

    def launches(fn) -> int:
        before = emu.stats()[0]
        fn()
        return emu.stats()[0] - before

    def pre(b):
        bufs = [torch.zeros(6, 10) for _ in range(b)]
        grads = [torch.randn(6, 10) for _ in range(b)]
        return lambda: emu.muon_pre_orthogonalize_(bufs, grads, 0.9, True, 1e-7, torch.bfloat16)

    def post(b):
        params = [torch.zeros(6, 10) for _ in range(b)]
        orth = torch.randn(b, 6, 10)
        return lambda: emu.muon_post_update_(params, orth, params, 0.1, 0.1, 1.0, True, 1e-8,
                                             True, True)

    def adamw(n):
        ts = [[torch.randn(9) for _ in range(n)] for _ in range(4)]
        for v in ts[3]:
            v.abs_()
        return lambda: emu.cautious_adamw_step_(*ts, 1e-3, 0.9, 0.99, 1e-8, 0.1, 1, True, True)

    assert launches(pre(2)) == launches(pre(MAX_MATS)) == 2
    assert launches(post(2)) == launches(post(MAX_MATS)) == 5  # 3 Muon+ stats, count, apply
    assert launches(adamw(2)) == launches(adamw(MAX_TENSORS)) == 2
