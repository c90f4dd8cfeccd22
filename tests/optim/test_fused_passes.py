"""The lean step's fused route (muon_fused.fused_step: one pre-pass and one update call over
every matrix of the step, as CUDA runs it with the extension) against the batched torch route
the CPU runs: through the ops' PyTorch bodies, and through the real kernels on the CPU emulator."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from speedtronic.optim import Muon, muon_fused, muon_step

# a square group, a wide/tall mixed group, an odd shape that is not a multiple of the 32 tile
SHAPES = [(16, 16), (16, 16), (48, 16), (16, 48), (9, 13)]


def _run(monkeypatch, fused: bool, steps: int = 3, groups_kw=None, **kw) -> list[torch.Tensor]:
    monkeypatch.setitem(muon_step.FUSED_ROUTE_OFF_CUDA, "cpu", fused)
    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(r, c)) for r, c in SHAPES]
    if groups_kw:
        groups = [{"params": params[:3], **groups_kw[0]}, {"params": params[3:], **groups_kw[1]}]
    else:
        groups = params
    opt = Muon(groups, lr=0.02, weight_decay=0.1, **kw)
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()
    return [p.detach().clone() for p in params]


CASES = [
    {},
    {"nesterov": False},
    {"muon_plus": True},
    {"cautious": True},
    {"cautious": True, "muon_plus": True},
    {"ns_dtype": "fp16"},
    {"muon_plus": True, "ns_dtype": "fp16"},
    {"cautious": True, "muon_plus": True, "ns_dtype": "fp16"},
    {"workspace_budget": 1},  # one matrix per Newton-Schulz batch: the chunked route
    {"muon_plus": True, "workspace_budget": 1},
]


@pytest.mark.parametrize("kw", CASES, ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items())
                         or "default")
def test_fused_route_matches_the_torch_route(monkeypatch, kw):
    torch_route = _run(monkeypatch, False, **kw)
    fused = _run(monkeypatch, True, **kw)
    tol = 2e-3 if kw.get("ns_dtype") == "fp16" else 1e-5
    for a, b in zip(fused, torch_route, strict=True):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)


def test_fused_route_reads_each_param_groups_hyper_parameters(monkeypatch):
    gk = [{"lr": 0.05, "momentum": 0.9, "weight_decay": 0.0}, {"lr": 0.01, "momentum": 0.8}]
    torch_route = _run(monkeypatch, False, groups_kw=gk)
    fused = _run(monkeypatch, True, groups_kw=gk)
    for a, b in zip(fused, torch_route, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("gk", [
    [{"muon_plus": True, "layout": "transposed"}, {"muon_plus": False}],
    [{"muon_plus": False}, {"muon_plus": True, "cautious": True}],
], ids=["plus-transposed-layout+plain", "plain+plus-cautious"])
def test_fused_muon_plus_scales_only_its_own_matrices_in_their_logical_orientation(monkeypatch,
                                                                                  gk):
    """Muon+ folded into the one update call: matrices of groups without it get no scales
    (the empty-tensor pair), and a ``transposed`` layout normalizes the logical (out, in)
    rows first, as the torch route does."""
    torch_route = _run(monkeypatch, False, groups_kw=gk)
    fused = _run(monkeypatch, True, groups_kw=gk)
    for a, b in zip(fused, torch_route, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_a_ns_result_laid_out_unlike_the_gradients_keeps_the_cautious_op(monkeypatch):
    """The folded mask reads the NS result and the gradient through one pair of strides; a
    result in another layout is masked before the update (the per-group route), with the same
    numbers."""
    real, real_choice = muon_fused._orthogonalizer, muon_fused.ops.kernel_or_fallback
    calls = []

    def strided(group, compute, newton_schulz):
        orthogonalize = real(group, compute, newton_schulz)
        return lambda X: orthogonalize(X).mT.contiguous().mT         # (c, m, n), column-major

    def recording(name, device, dtypes):
        fn = real_choice(name, device, dtypes)
        return lambda *args: calls.append(name) or fn(*args)

    torch_route = _run(monkeypatch, False, cautious=True)
    monkeypatch.setattr(muon_fused, "_orthogonalizer", strided)
    monkeypatch.setattr(muon_fused.ops, "kernel_or_fallback", recording)
    fused = _run(monkeypatch, True, cautious=True)
    assert "muon_lean_update_" in calls and "muon_lean_cautious_count_" not in calls
    for a, b in zip(fused, torch_route, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_fused_route_skips_a_non_finite_fp16_result_and_keeps_the_decay(monkeypatch):
    monkeypatch.setitem(muon_step.FUSED_ROUTE_OFF_CUDA, "cpu", True)
    p = nn.Parameter(torch.ones(8, 8))
    q = nn.Parameter(torch.ones(8, 16))
    opt = Muon([p, q], lr=0.1, weight_decay=0.5, ns_dtype="fp16")
    p.grad = torch.full((8, 8), float("inf"))
    q.grad = torch.randn(8, 16)
    opt.step()
    assert torch.equal(p.detach(), torch.full((8, 8), 1 - 0.1 * 0.5))  # decay only
    assert not torch.equal(q.detach(), torch.full((8, 16), 1 - 0.1 * 0.5))
    assert dict(opt.nonfinite_counts()) == {(8, 8): 1}


def test_fused_route_through_the_emulated_kernels(monkeypatch):
    """The step with the real CUDA kernel sources (csrc/kernels/muon_lean.cuh) on the emulator."""
    from _emu_fixtures import load_emulator

    emu = load_emulator()
    emu.configure("random", 3)
    real = muon_fused.ops.kernel_or_fallback

    def kernels(name, device, dtypes):
        if name.startswith("muon_lean_"):
            return getattr(emu, name)
        return real(name, device, dtypes)

    kw = {"muon_plus": True, "cautious": True}
    torch_route = _run(monkeypatch, False, **kw)
    monkeypatch.setattr(muon_fused.ops, "kernel_or_fallback", kernels)
    launches = emu.stats()[0]
    fused = _run(monkeypatch, True, **kw)
    # per step, one table: pre 2 + Muon+ stats 4 + the cautious count 1 + update 1 (the count's
    # zeroing is a torch op, not an emulated launch); the update applies both
    assert emu.stats()[0] - launches == 3 * (2 + 4 + 1 + 1)
    for a, b in zip(fused, torch_route, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kw", [{}, {"muon_plus": True, "cautious": True, "ns_dtype": "fp16"}],
                         ids=["plain", "muon_plus+cautious"])
def test_fused_route_compiles_to_one_graph_under_an_lr_schedule(monkeypatch, kw):
    from torch._dynamo import utils as dynamo_utils

    monkeypatch.setitem(muon_step.FUSED_ROUTE_OFF_CUDA, "cpu", True)
    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(r, c)) for r, c in SHAPES]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = Muon(params, lr=torch.tensor(0.02), weight_decay=0.01, **kw)
    opt.step()
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 1.0 / (i + 1))
    torch._dynamo.reset()
    dynamo_utils.counters.clear()
    step = torch.compile(lambda: type(opt).step(opt), fullgraph=True, backend="aot_eager")
    for _ in range(10):
        step()
        sched.step()
    assert dynamo_utils.counters["stats"]["unique_graphs"] == 1
    assert not dynamo_utils.counters.get("recompiles")


def test_fused_steps_with_muon_plus_and_cautious_repeat_the_same_op_stream(monkeypatch):
    """What a captured CUDA graph replays: with Muon+ and the cautious mask on the fused route, a
    later step dispatches exactly the ops (and scratch sizes) of the one before it, no sync."""
    from speedtronic.kernels.counting import DispatchCounter

    monkeypatch.setitem(muon_step.FUSED_ROUTE_OFF_CUDA, "cpu", True)
    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(r, c)) for r, c in SHAPES]
    opt = Muon(params, lr=0.02, weight_decay=0.1, muon_plus=True, cautious=True, ns_dtype="fp16")
    streams = []
    for _ in range(3):
        for p in params:
            p.grad = torch.randn_like(p)
        with DispatchCounter() as c:
            opt.step()
        streams.append((list(c.by_name.items()), c.host_syncs))
    assert streams[1] == streams[2] and streams[1][1] == 0
