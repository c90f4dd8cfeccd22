"""speedtronic.optim.Muon: drop-in parity with torch.optim.Muon, batching, state, errors."""

from __future__ import annotations

import inspect
import io

import pytest
import torch
from torch import nn

from speedtronic.kernels import ops
from speedtronic.optim import Muon

SHAPES = [(16, 16), (16, 16), (24, 16), (16, 24), (16, 16)]


@pytest.fixture(autouse=True)
def _one_thread():
    # Tiny GEMMs on a shared 2-core box: 2 OpenMP threads can be 100x slower than 1 under
    # contention (research section 6). Restore the setting for other test modules.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _setup(dtype: torch.dtype = torch.float32, seed: int = 0, steps: int = 20):
    g = torch.Generator().manual_seed(seed)
    init = [torch.randn(s, generator=g) for s in SHAPES]
    grads = [[torch.randn(s, generator=g) for s in SHAPES] for _ in range(steps)]
    return [w.to(dtype) for w in init], [[x.to(dtype) for x in gs] for gs in grads]


def _run(make, init, grads, dtype=None):
    params = [nn.Parameter(w.clone() if dtype is None else w.to(dtype)) for w in init]
    opt = make(params)
    for gs in grads:
        for p, g in zip(params, gs, strict=True):
            p.grad = g.clone().to(p.dtype)
        opt.step()
    return [p.detach().double() for p in params], opt


def _rel_disp(out, ref, init) -> float:
    num = sum((o - r).norm() ** 2 for o, r in zip(out, ref, strict=True)) ** 0.5
    den = sum((r - w.double()).norm() ** 2 for r, w in zip(ref, init, strict=True)) ** 0.5
    return (num / den).item()


KW = dict(lr=0.02, weight_decay=0.1, momentum=0.95)


def test_constructor_is_a_superset_of_torch_muon() -> None:
    theirs = inspect.signature(torch.optim.Muon.__init__).parameters
    ours = inspect.signature(Muon.__init__).parameters
    for name, param in theirs.items():
        assert name in ours, name
        if param.default is not inspect.Parameter.empty:
            assert ours[name].default == param.default, name
    assert list(ours)[:len(theirs)] == list(theirs)  # same positional order
    for extra in ("muon_plus", "cautious", "cautious_rescale"):
        assert ours[extra].default in (False, True)


@pytest.mark.parametrize("nesterov,adjust", [(True, None), (False, "match_rms_adamw")])
def test_follows_torch_muon_over_20_steps(nesterov: bool, adjust) -> None:
    init, grads = _setup()
    kw = dict(KW, nesterov=nesterov, adjust_lr_fn=adjust)
    ref, _ = _run(lambda ps: Muon(ps, **kw, ns_dtype="fp64"), init, grads, torch.float64)
    theirs, _ = _run(lambda ps: torch.optim.Muon(ps, **kw), init, grads)
    ours_bf16, _ = _run(lambda ps: Muon(ps, **kw, ns_dtype="bf16"), init, grads)
    ours_fp32, _ = _run(lambda ps: Muon(ps, **kw), init, grads)
    # Same algorithm in the same (bf16) precision: close to torch. torch's own bf16 error vs the
    # float64 run is ~4e-3 here, so "within bf16 tolerance" = 2e-2 of the total displacement.
    assert _rel_disp(ours_bf16, theirs, init) < 2e-2
    # fp32 NS (the CPU default) is ~100x closer to float64 than torch's bf16 path ...
    err_torch = _rel_disp(theirs, ref, init)
    err_fp32 = _rel_disp(ours_fp32, ref, init)
    assert err_fp32 < 1e-4 and err_fp32 < err_torch / 10
    # ... and still within torch's bf16 noise of torch (loose).
    assert _rel_disp(ours_fp32, theirs, init) < 3e-2


def test_bf16_params_with_nesterov_false_do_not_corrupt_state() -> None:
    # torch casts to bf16 and normalizes in place, which for bf16 params + nesterov=False hits
    # the momentum buffer itself (research section 1.1). Ours keeps an fp32 buffer untouched.
    init, grads = _setup(torch.bfloat16, steps=3)
    ours, opt = _run(lambda ps: Muon(ps, **KW, nesterov=False), init, grads)
    for p in opt.param_groups[0]["params"]:
        buf = opt.state[p]["momentum_buffer"]
        assert p.dtype == torch.bfloat16 and buf.dtype == torch.float32
    expected_buf = sum(0.05 * 0.95 ** (2 - k) * grads[k][0].double() for k in range(3))
    got_buf = opt.state[opt.param_groups[0]["params"][0]]["momentum_buffer"].double()
    assert torch.allclose(got_buf, expected_buf, atol=1e-6)
    assert all(torch.isfinite(p).all() and not torch.equal(p, w.double())
               for p, w in zip(ours, init, strict=True))


def test_one_newton_schulz_call_per_distinct_shape(monkeypatch) -> None:
    calls: list[tuple[int, ...]] = []
    real = ops._PYTHON_BODIES["newton_schulz"]  # what Muon calls on CPU

    def counting(G, *args, **kwargs):
        calls.append(tuple(G.shape))
        return real(G, *args, **kwargs)

    monkeypatch.setitem(ops._PYTHON_BODIES, "newton_schulz", counting)
    init, grads = _setup(steps=1)
    # Two groups with different lr: still one NS call per wide shape, the tall (24, 16) matrix
    # joining the (16, 24) one transposed (the update pass is per param group).
    params = [nn.Parameter(w.clone()) for w in init]
    opt = Muon([{"params": params[:2]}, {"params": params[2:], "lr": 0.01}], lr=0.02)
    for p, g in zip(params, grads[0], strict=True):
        p.grad = g
    opt.step()
    assert sorted(calls) == sorted([(3, 16, 16), (2, 16, 24)])


def test_the_workspace_budget_sets_the_batch_size(monkeypatch) -> None:
    """One Newton-Schulz batch per shape group by default; a budget of k matrices' workspace
    gives batches of k (muon_step.workspace_bytes_per_matrix)."""
    from speedtronic.optim.muon_step import workspace_bytes_per_matrix

    calls: list[tuple[int, ...]] = []
    real = ops._PYTHON_BODIES["newton_schulz"]

    def counting(G, *args, **kwargs):
        calls.append(tuple(G.shape))
        return real(G, *args, **kwargs)

    monkeypatch.setitem(ops._PYTHON_BODIES, "newton_schulz", counting)
    params = [nn.Parameter(torch.randn(16, 16)) for _ in range(8)]
    params.append(nn.Parameter(torch.randn(16, 64)))
    for p in params:
        p.grad = torch.randn_like(p)
    Muon(params, lr=0.02).step()
    assert sorted(calls) == [(1, 16, 64), (8, 16, 16)]
    calls.clear()
    per = workspace_bytes_per_matrix(16, 16, torch.float32)
    Muon(params, lr=0.02, workspace_budget=3 * per + 1).step()
    assert sorted(calls) == [(1, 16, 64), (2, 16, 16), (3, 16, 16), (3, 16, 16)]
    with pytest.raises(ValueError, match="workspace_budget"):
        Muon(params, workspace_budget=0)


def test_groups_keep_their_own_lr() -> None:
    init, grads = _setup(steps=2)
    together, _ = _run(lambda ps: Muon([{"params": ps[:3]}, {"params": ps[3:], "lr": 0.005}],
                                       lr=0.02), init, grads)
    a, _ = _run(lambda ps: Muon(ps, lr=0.02), init[:3], [g[:3] for g in grads])
    b, _ = _run(lambda ps: Muon(ps, lr=0.005), init[3:], [g[3:] for g in grads])
    for x, y in zip(together, a + b, strict=True):
        assert torch.allclose(x, y, atol=1e-6)


def test_momentum_state_is_fp32_and_survives_weights_only_roundtrip() -> None:
    init, grads = _setup(torch.bfloat16, steps=2)
    _, opt = _run(lambda ps: Muon(ps, **KW), init, grads)
    sd = opt.state_dict()
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)
    params = [nn.Parameter(w.clone()) for w in init]
    fresh = Muon(params, **KW)
    fresh.load_state_dict(loaded)
    for i, p in enumerate(params):
        got = fresh.state[p]["momentum_buffer"]
        assert got.dtype == torch.float32  # torch's loader would have cast it to bf16
        assert torch.equal(got, sd["state"][i]["momentum_buffer"])


def test_loads_torch_muon_state_dict() -> None:
    init, grads = _setup(steps=2)
    _, theirs = _run(lambda ps: torch.optim.Muon(ps, **KW), init, grads)
    params = [nn.Parameter(w.clone()) for w in init]
    ours = Muon(params, **KW)
    ours.load_state_dict(theirs.state_dict())
    assert torch.equal(ours.state[params[0]]["momentum_buffer"],
                       theirs.state[theirs.param_groups[0]["params"][0]]["momentum_buffer"])
    # torch's groups lack our keys: they take our defaults, and the next steps follow torch's.
    assert ours.param_groups[0]["ns_dtype"] == "auto" and ours.param_groups[0]["muon_plus"] is False
    theirs_params = theirs.param_groups[0]["params"]
    with torch.no_grad():
        for p, q in zip(params, theirs_params, strict=True):
            p.copy_(q)
    start = [q.detach().clone() for q in theirs_params]
    more = [[torch.randn(w.shape, generator=torch.Generator().manual_seed(90 + i)) for w in init]
            for i in range(3)]
    for step_grads in more:
        for p, q, g in zip(params, theirs_params, step_grads, strict=True):
            p.grad, q.grad = g.clone(), g.clone()
        ours.step()
        theirs.step()
    # torch runs Newton-Schulz in bf16 on CPU: ~1e-2 of the displacement (see above)
    assert _rel_disp([p.detach().double() for p in params],
                     [q.detach().double() for q in theirs_params], start) < 3e-2


def test_small_updates_are_normalized_like_torch_muon() -> None:
    # torch divides by max(||U||, eps), not ||U|| + eps: at ||U|| = 1e-6 (eps 1e-7) the two
    # differ by 10% before Newton-Schulz, ~12% after. float64 reference of torch's formula.
    g = torch.randn(8, 16, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    for scale in (1e-6, 1e-9):  # above and below eps
        grad = g / g.norm() * scale
        p = nn.Parameter(torch.zeros(8, 16, dtype=torch.float64))
        p.grad = grad.clone()
        Muon([p], lr=0.02, momentum=0.0, nesterov=False, weight_decay=0.0, ns_dtype="fp64").step()
        X = grad / grad.norm().clamp(min=1e-7)
        a, b, c = ops.QUINTIC
        for _ in range(5):
            A = X @ X.mT
            X = a * X + (b * A + c * A @ A) @ X
        expected = -0.02 * X
        # the pre-pass is fp32 whatever the parameter dtype; ``+ eps`` was off by ~1e-1 here
        assert (p.detach() - expected).norm() / expected.norm() < 1e-6


def test_non_contiguous_parameter_steps_like_its_contiguous_copy() -> None:
    base = torch.randn(8, 16, generator=torch.Generator().manual_seed(6))
    grad = torch.randn(16, 8, generator=torch.Generator().manual_seed(7))
    transposed = nn.Parameter(base.clone().t())  # (16, 8) view with strides (1, 16)
    plain = nn.Parameter(base.clone().t().contiguous())
    for p in (transposed, plain):
        p.grad = grad.clone()
        Muon([p], lr=0.02).step()
    assert not transposed.is_contiguous() and torch.equal(transposed, plain)
    # torch.optim.Muon steps such a parameter too: ours agrees with it
    theirs = nn.Parameter(base.clone().t())
    theirs.grad = grad.clone()
    torch.optim.Muon([theirs], lr=0.02).step()
    assert (transposed - theirs).norm() / theirs.norm() < 1e-2


def test_rejected_param_group_is_not_kept() -> None:
    opt = Muon([nn.Parameter(torch.randn(8, 16))])
    with pytest.raises(ValueError, match="2D parameters"):
        opt.add_param_group({"params": [nn.Parameter(torch.randn(3))]})
    assert len(opt.param_groups) == 1
    opt.param_groups[0]["params"][0].grad = torch.randn(8, 16)
    opt.step()  # still usable


@pytest.mark.parametrize("muon_plus,cautious", [(True, False), (False, True), (True, True)])
def test_muon_plus_and_cautious_match_float64_step(muon_plus: bool, cautious: bool) -> None:
    init, grads = _setup(steps=1)
    ours, _ = _run(lambda ps: Muon(ps, **KW, muon_plus=muon_plus, cautious=cautious), init, grads)
    for w, g, got in zip(init, grads[0], ours, strict=True):
        w, g = w.double(), g.double()
        buf = 0.05 * g
        u = g + 0.95 * (buf - g)
        o = ops.newton_schulz(u, 5, list(ops.QUINTIC), 1e-7, torch.float64)
        if muon_plus:
            o = o / (o.pow(2).sum(1, keepdim=True) + 1e-8).sqrt()
            o = o / (o.pow(2).sum(0, keepdim=True) + 1e-8).sqrt()
        if cautious:
            mask = (o * g > 0).double()
            o = o * mask * (o.numel() / (mask.sum() + 1))
        scale = max(1.0, w.shape[0] / w.shape[1]) ** 0.5
        expected = w * (1 - 0.02 * 0.1) - 0.02 * scale * o
        assert ((got - expected).norm() / (expected - w).norm()).item() < 1e-4


def test_polar_express_schedule_by_name() -> None:
    init, grads = _setup(steps=2)
    ours, opt = _run(lambda ps: Muon(ps, **KW, ns_coefficients="polar_express"), init, grads)
    assert opt.param_groups[0]["ns_coefficients"] == "polar_express"
    assert all(torch.isfinite(p).all() for p in ours)


def test_errors_are_clear() -> None:
    with pytest.raises(ValueError, match="2D parameters"):
        Muon([nn.Parameter(torch.randn(3))])
    with pytest.raises(ValueError, match="adjust_lr_fn"):
        Muon([nn.Parameter(torch.randn(3, 3))], adjust_lr_fn="nope")
    with pytest.raises(ValueError, match="ns_dtype"):
        Muon([nn.Parameter(torch.randn(3, 3))], ns_dtype="int8")
    with pytest.raises(ValueError, match="ns_dtype torch.int8 is not supported; valid: .*bfloat16"):
        Muon([nn.Parameter(torch.randn(3, 3))], ns_dtype=torch.int8)  # was a TypeError from sorted
    with pytest.raises(TypeError, match="ns_steps must be an int, got 2.5"):
        Muon([nn.Parameter(torch.randn(3, 3))], ns_steps=2.5)  # silently ran 2 iterations
    # stricter than torch.optim.Muon: each of these ran, into a growing buffer or NaN weights
    with pytest.raises(ValueError, match=r"momentum must be in \[0, 1\), got 1.5"):
        Muon([nn.Parameter(torch.randn(3, 3))], momentum=1.5)
    with pytest.raises(ValueError, match="norm_eps must be > 0"):
        Muon([nn.Parameter(torch.randn(3, 3))], muon_plus=True, norm_eps=-1.0)
    with pytest.raises(ValueError, match="eps must be > 0"):
        Muon([nn.Parameter(torch.randn(3, 3))], eps=0.0)
    with pytest.raises(TypeError, match="nesterov must be True or False, got 'yes'"):
        Muon([nn.Parameter(torch.randn(3, 3))], nesterov="yes")
    p = nn.Parameter(torch.randn(4, 4))
    p.grad = torch.eye(4).to_sparse()
    with pytest.raises(RuntimeError, match="sparse"):
        Muon([p]).step()
    pc = nn.Parameter(torch.randn(4, 4, dtype=torch.complex64))
    pc.grad = torch.randn(4, 4, dtype=torch.complex64)
    with pytest.raises(RuntimeError, match="complex"):
        Muon([pc]).step()


def test_params_without_grad_are_skipped_and_closure_returned() -> None:
    a, b = nn.Parameter(torch.randn(8, 8)), nn.Parameter(torch.randn(8, 8))
    before = b.detach().clone()
    opt = Muon([a, b], lr=0.02)

    returned = []
    a_before = a.detach().clone()

    def closure():
        opt.zero_grad()
        loss = (a ** 2).sum()
        loss.backward()
        returned.append(loss)
        return loss

    assert opt.step(closure) is returned[0]  # torch's contract: the closure's own loss
    assert not torch.equal(a, a_before)
    assert torch.equal(b, before) and b not in opt.state


@pytest.mark.parametrize("rescale", [False, True])
def test_cautious_leaves_entries_with_a_zero_gradient_alone(rescale) -> None:
    """The mask keeps an update entry only where it agrees in sign with the gradient: where
    the gradient is exactly 0 nothing moves, though the orthogonalized update is non-zero
    there (scattered zeros: whole zero rows or columns stay zero through Newton-Schulz)."""
    torch.manual_seed(4)
    w = nn.Parameter(torch.randn(8, 16))
    before = w.detach().clone()
    g = torch.randn(8, 16)
    zero = torch.zeros(8, 16, dtype=torch.bool)
    zero.view(-1)[::3] = True
    g[zero] = 0.0
    w.grad = g
    opt = Muon([w], lr=0.02, weight_decay=0.0, cautious=True, cautious_rescale=rescale)
    opt.step()
    assert torch.equal(w[zero], before[zero])
    assert (w[~zero] != before[~zero]).float().mean() > 0.3  # the kept entries moved


def test_huge_shape_groups_are_split_and_give_the_same_result(monkeypatch) -> None:
    init, grads = _setup(steps=2)
    whole, _ = _run(lambda ps: Muon(ps, **KW), init, grads)
    calls: list[tuple[int, ...]] = []
    real = ops._PYTHON_BODIES["newton_schulz"]  # what Muon calls on CPU

    def counting(G, *args, **kwargs):
        calls.append(tuple(G.shape))
        return real(G, *args, **kwargs)

    monkeypatch.setitem(ops._PYTHON_BODIES, "newton_schulz", counting)
    from speedtronic.optim.muon_step import workspace_bytes_per_matrix

    budget = 2 * workspace_bytes_per_matrix(16, 24, torch.float32)  # two 16x16, one 16x24
    split, _ = _run(lambda ps: Muon(ps, **KW, workspace_budget=budget), init, grads)
    assert sorted(calls[:3]) == [(1, 16, 16), (2, 16, 16), (2, 16, 24)]
    for a, b in zip(whole, split, strict=True):
        assert torch.allclose(a, b, atol=1e-6)


@pytest.mark.parametrize("cautious", [False, True])
def test_muon_plus_normalizes_a_transposed_weight_in_its_logical_layout(cautious) -> None:
    """A weight stored (in, out) (layout "transposed", GPT-2's Conv1D) gets the transpose of the
    update of the same weight stored (out, in): Muon+ normalizes fan-out rows first in both (it
    normalized the stored rows first, 29% off)."""
    torch.manual_seed(0)
    w, g = torch.randn(40, 24), torch.randn(40, 24)                      # (out, in)
    a, b = nn.Parameter(w.clone()), nn.Parameter(w.T.contiguous())      # (out, in), (in, out)
    kw = dict(lr=0.02, weight_decay=0.0, muon_plus=True, cautious=cautious)
    opt_a = Muon([a], **kw)
    opt_b = Muon([{"params": [b], "layout": "transposed"}], **kw)
    a.grad, b.grad = g.clone(), g.T.contiguous()
    opt_a.step()
    opt_b.step()
    torch.testing.assert_close(b.detach().T, a.detach(), rtol=1e-5, atol=1e-6)


def test_cpu_steps_reuse_their_newton_schulz_buffers_and_match_fresh_allocation(monkeypatch):
    """Eager CPU steps write the NS products into per-group buffers kept between steps (no
    fresh page-faulted memory each step): the same buffers every step, and parameters bitwise
    equal to steps whose products are all freshly allocated."""
    from speedtronic.kernels import newton_schulz as ns

    init, grads = _setup(steps=3)
    kept, opt = _run(lambda ps: Muon(ps, **KW), init, grads[:2])
    groups = opt.muon_cache.groups
    held = [(g.ns_workspace.nbytes, sorted(b.data_ptr() for pool in g.ns_workspace._pool.values()
                                           for b in pool)) for g in groups]
    assert all(n > 0 for n, _ in held)
    for p, g in zip(opt.param_groups[0]["params"], grads[2], strict=True):
        p.grad = g.clone()
    opt.step()
    assert held == [(g.ns_workspace.nbytes, sorted(b.data_ptr() for pool in
                                                   g.ns_workspace._pool.values() for b in pool))
                    for g in groups]
    kept = [p.detach().clone() for p in opt.param_groups[0]["params"]]
    monkeypatch.setattr(ns.Workspace, "out",
                        lambda self, shape, like, live: torch.empty(tuple(shape),
                                                                    dtype=like.dtype))
    fresh, _ = _run(lambda ps: Muon(ps, **KW), init, grads)
    for a, b in zip(kept, fresh, strict=True):
        assert torch.equal(a, b)
