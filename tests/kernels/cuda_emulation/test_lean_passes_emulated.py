"""The lean Muon step's fused passes (csrc/kernels/muon_lean.cuh) on the CPU emulator against
their PyTorch bodies in kernels.ops: every matrix of a step in one call, mixed shapes, tall
matrices read through their transposed views, per-matrix hyper-parameter tensors, the guard's
skip flags, and tables longer than one launch (st::kLeanMats = 128 matrices)."""

from __future__ import annotations

import pytest
import torch
from _emu_fixtures import load_emulator

import speedtronic.kernels.ops as ops

LEAN_MATS = 128  # st::kLeanMats


@pytest.fixture(scope="session")
def emu():
    return load_emulator()


@pytest.fixture(params=("forward", "random"))
def sched(request, emu):
    emu.configure(request.param, 7)
    return request.param


def _grads(shapes, dtype, gen):
    """Bank-orientation (m, n) views: a tall gradient (n, m) is passed as its .mT."""
    out = []
    for (m, n), tall in shapes:
        g = torch.randn((n, m) if tall else (m, n), generator=gen).to(dtype)
        out.append(g.mT if tall else g)
    return out


# (bank shape, stored tall): awkward edges (not multiples of 32), a 1-row matrix, tall ones
SHAPES = [((33, 70), False), ((33, 70), True), ((5, 5), False), ((1, 40), False),
          ((64, 96), True), ((40, 33), False)]


@pytest.mark.parametrize("gdtype,odtype", [(torch.float32, torch.float32),
                                           (torch.bfloat16, torch.float16),
                                           (torch.float16, torch.bfloat16)])
@pytest.mark.parametrize("copies", [False, True])
def test_lean_pre_matches_reference(emu, sched, gdtype, odtype, copies):
    gen = torch.Generator().manual_seed(0)
    grads = _grads(SHAPES, gdtype, gen)
    mom = [torch.randn(g.shape, generator=gen) for g in grads]
    mus = [torch.tensor(0.95), torch.tensor(0.8)]
    mu_index = [i % 2 for i in range(len(grads))]
    nesterov = [int(i % 3 != 1) for i in range(len(grads))]
    eps = [1e-7] * len(grads)
    runs = {}
    for name, fn in (("emu", emu.muon_lean_pre_), ("ref", ops._lean_pre_impl)):
        m = [t.clone() for t in mom]
        outs = [torch.full(g.shape, float("nan"), dtype=odtype) for g in grads]
        gc = [torch.full(g.shape, float("nan")) for g in grads] if copies else []
        fn(grads, m, outs, gc, mus, mu_index, nesterov, eps)
        runs[name] = (m, outs, gc)
    for i in range(len(grads)):
        torch.testing.assert_close(runs["emu"][0][i], runs["ref"][0][i], rtol=1e-6, atol=1e-6)
        tol = 1e-6 if odtype == torch.float32 else 1e-2
        torch.testing.assert_close(runs["emu"][1][i].float(), runs["ref"][1][i].float(),
                                   rtol=tol, atol=tol)
        if copies:
            assert torch.equal(runs["emu"][2][i], grads[i].float())


def test_lean_pre_many_matrices_and_zero_gradient(emu):
    """More matrices than one launch table; a zero gradient with zero momentum divides by eps."""
    emu.configure("forward", 0)
    gen = torch.Generator().manual_seed(1)
    shapes = [((8 + i % 5, 12 + i % 7), i % 2 == 1) for i in range(LEAN_MATS + 9)]
    grads = _grads(shapes, torch.float32, gen)
    grads[3] = torch.zeros_like(grads[3])
    mom = [torch.randn(g.shape, generator=gen) for g in grads]
    mom[3].zero_()
    args = ([torch.tensor(0.9)], [0] * len(grads), [1] * len(grads), [1e-7] * len(grads))
    a, b = [t.clone() for t in mom], [t.clone() for t in mom]
    oa = [torch.empty(g.shape) for g in grads]
    ob = [torch.empty(g.shape) for g in grads]
    emu.muon_lean_pre_(grads, a, oa, [], *args)
    ops._lean_pre_impl(grads, b, ob, [], *args)
    for x, y in zip(oa + a, ob + b, strict=True):
        torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-6)
    assert torch.equal(oa[3], torch.zeros_like(oa[3]))
    assert emu.stats()[0] >= 4  # 2 passes x 2 tables


def test_lean_pre_keeps_a_nan_norm_as_the_reference_does(emu):
    """torch's clamp(min=eps) keeps a NaN norm; the kernel's fmaxf turned it into eps, so one
    NaN gradient entry scaled the rest of its matrix by 1/eps (entries of -3e6, or inf in
    fp16). Now the whole matrix is NaN on both sides, which the 16-bit guard skips."""
    emu.configure("forward", 0)
    gen = torch.Generator().manual_seed(2)
    grads = [torch.randn(6, 10, generator=gen) * 1e-3 for _ in range(2)]
    grads[0][2, 3] = float("nan")
    args = ([torch.tensor(0.9)], [0, 0], [1, 1], [1e-7, 1e-7])
    for odtype in (torch.float32, torch.float16):
        outs = {}
        for name, fn in (("emu", emu.muon_lean_pre_), ("ref", ops._lean_pre_impl)):
            m = [torch.zeros(6, 10), torch.zeros(6, 10)]
            o = [torch.empty(6, 10, dtype=odtype) for _ in range(2)]
            fn(grads, m, o, [], *args)
            outs[name] = o
        assert outs["emu"][0].isnan().all() and outs["ref"][0].isnan().all()
        torch.testing.assert_close(outs["emu"][1].float(), outs["ref"][1].float(),
                                   rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("pdtype,udtype", [(torch.float32, torch.float16),
                                           (torch.float32, torch.float32),
                                           (torch.bfloat16, torch.float32)])
def test_lean_update_matches_reference(emu, sched, pdtype, udtype):
    gen = torch.Generator().manual_seed(2)
    # parameters: dense, a transposed view (the kernel walks it in memory order), a row block
    base = torch.randn(96, 40, generator=gen).to(pdtype)
    params = [torch.randn(33, 70, generator=gen).to(pdtype),
              torch.randn(70, 33, generator=gen).to(pdtype).mT,
              base[8:40], torch.randn(1, 5, generator=gen).to(pdtype)]
    # updates: a bank slice read as the parameter's transpose for the first two
    bank = torch.randn(2, 70, 33, generator=gen).to(udtype)
    updates = [bank[0].mT, bank[1].mT, torch.randn(32, 40, generator=gen).to(udtype),
               torch.randn(1, 5, generator=gen).to(udtype)]
    lrs = [torch.tensor(0.02), torch.tensor(0.5)]
    wds = [torch.tensor(0.1), torch.tensor(0.0)]
    skip = torch.tensor([False, True])
    args = (lrs, wds, [0, 1, 0, 1], [1.5, 1.0, 0.7, 2.0], skip, [0, 1, -1, 0], [], [], [], None,
            [])
    ref = [p.clone() for p in params]
    emu.muon_lean_update_(params, updates, *args)
    ops._lean_update_impl(ref, updates, *args)
    tol = 1e-6 if pdtype == torch.float32 else 8e-3
    for p, r in zip(params, ref, strict=True):
        torch.testing.assert_close(p, r, rtol=tol, atol=tol)
    # the skipped matrix kept its decay only (wd = 0 for group 1: unchanged)
    assert torch.equal(params[1], ref[1])


def test_lean_ops_reject_bad_input(emu):
    g = [torch.zeros(4, 4)]
    with pytest.raises(ValueError, match="momenta must be float32"):
        emu.muon_lean_pre_(g, [torch.zeros(4, 4, dtype=torch.bfloat16)], [torch.zeros(4, 4)],
                           [], [torch.tensor(0.9)], [0], [1], [1e-7])
    with pytest.raises(ValueError, match="mu_index"):
        emu.muon_lean_pre_(g, [torch.zeros(4, 4)], [torch.zeros(4, 4)], [],
                           [torch.tensor(0.9)], [1], [1], [1e-7])
    with pytest.raises(ValueError, match="contiguous"):
        emu.muon_lean_pre_(g, [torch.zeros(8, 4)[::2]], [torch.zeros(4, 4)], [],
                           [torch.tensor(0.9)], [0], [1], [1e-7])
    with pytest.raises(ValueError, match="updates\\[0\\] must match"):
        emu.muon_lean_update_(g, [torch.zeros(4, 3)], [torch.tensor(0.1)], [torch.tensor(0.0)],
                              [0], [1.0], None, [-1], [], [], [], None, [])
    with pytest.raises(ValueError, match="skip_index"):
        emu.muon_lean_update_(g, [torch.zeros(4, 4)], [torch.tensor(0.1)], [torch.tensor(0.0)],
                              [0], [1.0], None, [0], [], [], [], None, [])
    with pytest.raises(ValueError, match="row_scales\\[0\\] must be a contiguous float32"):
        emu.muon_lean_update_(g, [torch.zeros(4, 4)], [torch.tensor(0.1)], [torch.tensor(0.0)],
                              [0], [1.0], None, [-1], [torch.zeros(3)], [torch.zeros(4)], [],
                              None, [])
    with pytest.raises(ValueError, match="col_scales\\[0\\]"):
        emu.muon_lean_plus_stats_(g, [torch.zeros(4)], [torch.zeros(4, dtype=torch.float16)],
                                  [1e-8])


def _plus_updates(dtype, gen):
    """Muon+ inputs as the step hands them over: dense, a bank slice read transposed (the
    logical matrix of a flipped part), awkward edges, a 1-row matrix."""
    bank = torch.randn(2, 40, 70, generator=gen).to(dtype)
    return [torch.randn(33, 70, generator=gen).to(dtype), bank[0].mT, bank[1],
            torch.randn(1, 37, generator=gen).to(dtype),
            torch.randn(96, 65, generator=gen).to(dtype)]


@pytest.mark.parametrize("udtype", [torch.float32, torch.float16, torch.bfloat16])
def test_lean_plus_stats_match_reference_and_the_muon_plus_op(emu, sched, udtype):
    gen = torch.Generator().manual_seed(5)
    updates = _plus_updates(udtype, gen)
    eps = [1e-8, 1e-6, 1e-8, 1e-8, 1e-7]
    runs = {}
    for name, fn in (("emu", emu.muon_lean_plus_stats_), ("ref", ops._lean_plus_stats_impl)):
        rows = [torch.full((u.shape[0],), float("nan")) for u in updates]
        cols = [torch.full((u.shape[1],), float("nan")) for u in updates]
        fn(updates, rows, cols, eps)
        runs[name] = (rows, cols)
    for i, u in enumerate(updates):
        for k in (0, 1):
            torch.testing.assert_close(runs["emu"][k][i], runs["ref"][k][i], rtol=1e-5, atol=0)
        # (U r) c is Muon+'s normalization: the same numbers as the standalone op
        applied = u.float() * runs["emu"][0][i][:, None] * runs["emu"][1][i][None, :]
        torch.testing.assert_close(applied, ops._muon_plus_impl(u.float(), eps[i]),
                                   rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("pdtype,udtype", [(torch.float32, torch.float16),
                                           (torch.float32, torch.float32),
                                           (torch.bfloat16, torch.float32)])
def test_lean_update_applies_muon_plus_scales_in_either_walk(emu, sched, pdtype, udtype):
    """The scales are indexed by the update's rows and columns, also when the kernel walks a
    parameter stored transposed (the swap), and a pair of empty tensors means no scaling."""
    gen = torch.Generator().manual_seed(6)
    params = [torch.randn(33, 70, generator=gen).to(pdtype),
              torch.randn(70, 33, generator=gen).to(pdtype).mT,
              torch.randn(40, 24, generator=gen).to(pdtype)]
    bank = torch.randn(70, 33, generator=gen).to(udtype)
    updates = [torch.randn(33, 70, generator=gen).to(udtype), bank.mT,
               torch.randn(40, 24, generator=gen).to(udtype)]
    rows = [torch.rand(33, generator=gen) + 0.5, torch.rand(33, generator=gen) + 0.5,
            torch.empty(0)]
    cols = [torch.rand(70, generator=gen) + 0.5, torch.rand(70, generator=gen) + 0.5,
            torch.empty(0)]
    args = ([torch.tensor(0.03)], [torch.tensor(0.1)], [0, 0, 0], [1.0, 2.0, 1.5], None,
            [-1, -1, -1], rows, cols, [], None, [])
    ref = [p.clone() for p in params]
    plain = [p.clone() for p in params]
    emu.muon_lean_update_(params, updates, *args)
    ops._lean_update_impl(ref, updates, *args)
    emu.muon_lean_update_(plain, updates, *args[:-5], [], [], [], None, [])
    tol = 1e-6 if pdtype == torch.float32 else 8e-3
    for p, r in zip(params, ref, strict=True):
        torch.testing.assert_close(p, r, rtol=tol, atol=tol)
    assert torch.equal(params[2], plain[2])            # no scales for the last one
    assert not torch.allclose(params[0], plain[0])     # the scales did act on the others


def test_lean_plus_stats_many_matrices(emu):
    """More matrices than one launch table; a zero matrix gives 1 / sqrt(eps)."""
    emu.configure("forward", 0)
    gen = torch.Generator().manual_seed(7)
    updates = [torch.randn(8 + i % 5, 12 + i % 7, generator=gen) for i in range(LEAN_MATS + 9)]
    updates[3] = torch.zeros_like(updates[3])
    eps = [1e-8] * len(updates)
    out = {}
    for name, fn in (("emu", emu.muon_lean_plus_stats_), ("ref", ops._lean_plus_stats_impl)):
        rows = [torch.empty(u.shape[0]) for u in updates]
        cols = [torch.empty(u.shape[1]) for u in updates]
        fn(updates, rows, cols, eps)
        out[name] = rows + cols
    for x, y in zip(out["emu"], out["ref"], strict=True):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=0)
    assert torch.all(out["emu"][3] == 1e4)


def _cautious_case(udtype, gen):
    """Parameters and update directions as the fused step hands them over (dense, a bank slice
    read as a stored-transposed parameter's update, an odd shape), with gradients laid out like
    each update (the same view of an fp32 bank)."""
    params = [torch.randn(33, 70, generator=gen), torch.randn(70, 33, generator=gen).mT,
              torch.randn(9, 13, generator=gen)]
    bank_u = torch.randn(2, 70, 33, generator=gen).to(udtype)
    bank_g = torch.randn(2, 70, 33, generator=gen)
    updates = [bank_u[0].mT, bank_u[1].mT, torch.randn(9, 13, generator=gen).to(udtype)]
    grads = [bank_g[0].mT, bank_g[1].mT, torch.randn(9, 13, generator=gen)]
    return params, updates, grads


@pytest.mark.parametrize("udtype", [torch.float32, torch.float16])
def test_lean_cautious_count_and_masked_update_match_reference(emu, sched, udtype):
    gen = torch.Generator().manual_seed(8)
    params, updates, grads = _cautious_case(udtype, gen)
    kept = {"emu": torch.full((3,), -5, dtype=torch.int64),
            "ref": torch.zeros(3, dtype=torch.int64)}
    emu.muon_lean_cautious_count_(updates, grads, kept["emu"])   # zeroes it first
    ops._lean_cautious_count_impl(updates, grads, kept["ref"])
    assert torch.equal(kept["emu"], kept["ref"])
    assert 0 < int(kept["emu"][0]) < updates[0].numel()
    rows = [torch.rand(33, generator=gen) + 0.5, torch.empty(0), torch.empty(0)]
    cols = [torch.rand(70, generator=gen) + 0.5, torch.empty(0), torch.empty(0)]
    # matrix 0: Muon+ scales and a rescaled mask; 1: the mask without rescale; 2: no mask
    args = ([torch.tensor(0.03)], [torch.tensor(0.1)], [0, 0, 0], [1.0, 2.0, 1.5], None,
            [-1, -1, -1], rows, cols, [grads[0], grads[1], torch.empty(0)], kept["emu"],
            [0, -1, -1])
    ref = [p.clone() for p in params]
    start = [p.clone() for p in params]
    emu.muon_lean_update_(params, updates, *args)
    ops._lean_update_impl(ref, updates, *args)
    for p, r in zip(params, ref, strict=True):
        torch.testing.assert_close(p, r, rtol=1e-6, atol=1e-6)
    # the reference itself: the standalone cautious op on the Muon+-scaled direction
    u0 = updates[0].float() * rows[0][:, None] * cols[0][None, :]
    ops.cautious_mask_([u0], [grads[0].contiguous()], True)
    ops._lean_update_impl(start, [u0.contiguous()] + updates[1:], *args[:-5], [], [],
                          [torch.empty(0), grads[1], torch.empty(0)], None,
                          [-1, -1, -1])
    torch.testing.assert_close(start[0], params[0], rtol=1e-6, atol=1e-6)


def test_lean_cautious_ops_reject_mislaid_gradients(emu):
    u = [torch.zeros(4, 6)]
    with pytest.raises(ValueError, match="grads\\[0\\] must be float32 with updates\\[0\\]"):
        emu.muon_lean_cautious_count_(u, [torch.zeros(6, 4).mT.contiguous().mT],
                                      torch.zeros(1, dtype=torch.int64))
    with pytest.raises(ValueError, match="kept must be a contiguous 1-D int64"):
        emu.muon_lean_cautious_count_(u, [torch.zeros(4, 6)], torch.zeros(1))
    with pytest.raises(ValueError, match="kept_index"):
        emu.muon_lean_update_(u, u, [torch.tensor(0.1)], [torch.tensor(0.0)], [0], [1.0], None,
                              [-1], [], [], [torch.zeros(4, 6)], torch.zeros(1, dtype=torch.int64),
                              [3])


def test_lean_plus_stats_of_an_empty_dimension_are_one_over_sqrt_eps(emu):
    """An (r, 0) or (0, c) matrix has no partials: its non-empty scales are 1 / sqrt(eps), as
    the PyTorch body writes them."""
    emu.configure("forward", 0)
    updates = [torch.zeros(5, 0), torch.zeros(0, 7), torch.randn(3, 4)]
    rows = [torch.full((u.shape[0],), float("nan")) for u in updates]
    cols = [torch.full((u.shape[1],), float("nan")) for u in updates]
    emu.muon_lean_plus_stats_(updates, rows, cols, [1e-8] * 3)
    assert torch.equal(rows[0], torch.full((5,), 1e4))
    assert torch.equal(cols[1], torch.full((7,), 1e4))
    assert not rows[2].isnan().any() and not cols[2].isnan().any()
