"""The optimizer inside the tools users wrap it in: ``torch.compile`` of the step (no graph
breaks, same result as eager) and ``torch.amp.GradScaler`` (steps with finite gradients equal the
unscaled step; a step with an inf is skipped and leaves parameters and state untouched)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch._dynamo.utils as dynamo_utils
from torch import nn

from speedtronic.config import OptimizerConfig
from speedtronic.optim import build_optimizer

CASES = [("muon", False), ("muon", True), ("adamw", False), ("adamw", True)]


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(20, 16), nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16),
                         nn.LayerNorm(16), nn.Linear(16, 20))


def _loss(model: nn.Module, seed: int) -> torch.Tensor:
    ids = torch.randint(0, 20, (4, 8), generator=torch.Generator().manual_seed(seed))
    return model(ids).logsumexp(-1).mean()


def _backward(model: nn.Module, seed: int) -> None:
    _loss(model, seed).backward()


@pytest.mark.parametrize("name,cautious", CASES)
def test_compiled_step_has_no_graph_breaks(name, cautious):
    model = _model()
    opt = build_optimizer(model, OptimizerConfig(name=name, cautious=cautious))
    _backward(model, 0)
    torch._dynamo.reset()
    explanation = torch._dynamo.explain(opt.step)()
    assert explanation.graph_break_count == 0, [str(b.reason)[:300]
                                                for b in explanation.break_reasons]
    assert explanation.graph_count == 1


@pytest.mark.parametrize("name,cautious", CASES)
def test_compiled_step_matches_eager_without_recompiling(name, cautious):
    eager_model = _model()
    compiled_model = copy.deepcopy(eager_model)
    cfg = OptimizerConfig(name=name, cautious=cautious)
    eager_opt = build_optimizer(eager_model, cfg)
    compiled_opt = build_optimizer(compiled_model, cfg)
    torch._dynamo.reset()
    dynamo_utils.counters.clear()
    # aot_eager: the whole torch.compile front end (Dynamo, AOTAutograd's functionalization of
    # the in-place custom ops) without inductor's C++ build, which takes minutes on CI.
    step = torch.compile(compiled_opt.step, backend="aot_eager")
    for seed in range(4):
        for model, opt in ((eager_model, eager_opt), (compiled_model, compiled_opt)):
            opt.zero_grad()
            _backward(model, seed)
        eager_opt.step()
        step()
    for a, b in zip(eager_model.parameters(), compiled_model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    # One graph for the first step (creates the state), one for every later step.
    assert dynamo_utils.counters["stats"]["unique_graphs"] == 2


@pytest.mark.parametrize("name,cautious", CASES)
def test_grad_scaler_unscales_and_skips_non_finite_steps(name, cautious):
    plain_model = _model()
    scaled_model = copy.deepcopy(plain_model)
    cfg = OptimizerConfig(name=name, cautious=cautious, grad_clip=None)
    plain_opt = build_optimizer(plain_model, cfg)
    scaled_opt = build_optimizer(scaled_model, cfg)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 12)
    for seed in range(3):
        plain_opt.zero_grad()
        scaled_opt.zero_grad()
        _backward(plain_model, seed)
        scaler.scale(_loss(scaled_model, seed)).backward()
        plain_opt.step()
        scaler.step(scaled_opt)
        scaler.update()
    for a, b in zip(plain_model.parameters(), scaled_model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)

    # An overflow: the step is skipped, nothing moves, and the scale is halved.
    before_params = [p.detach().clone() for p in scaled_model.parameters()]
    before_state = copy.deepcopy(scaled_opt.state_dict())
    scale = scaler.get_scale()
    scaled_opt.zero_grad()
    scaler.scale(_loss(scaled_model, 9)).backward()
    next(scaled_model[1].parameters()).grad[0, 0] = float("inf")
    scaler.step(scaled_opt)
    scaler.update()
    assert scaler.get_scale() == scale / 2
    for a, b in zip(before_params, scaled_model.parameters(), strict=True):
        torch.testing.assert_close(a, b.detach(), rtol=0, atol=0)
    after_state = scaled_opt.state_dict()["state"]
    for key, entry in before_state["state"].items():
        for field, value in entry.items():
            torch.testing.assert_close(value, after_state[key][field], rtol=0, atol=0)


class _Layouts(nn.Module):
    """One tensor per Muon layout: split:3 (MultiheadAttention), flatten (1x1 conv), matrix."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(20, 16)
        self.attn = nn.MultiheadAttention(16, 2, batch_first=True)
        self.pointwise = nn.Conv1d(16, 16, 1)
        self.head = nn.Linear(16, 20)

    def forward(self, ids):
        x = self.embed(ids)                                        # (B, T, C)
        x = x + self.attn(x, x, x, need_weights=False)[0]
        x = x + self.pointwise(x.mT).mT
        return self.head(x)


def test_every_layout_compiles_without_graph_breaks_and_matches_eager():
    torch.manual_seed(0)
    eager_model = _Layouts()
    compiled_model = copy.deepcopy(eager_model)
    cfg = OptimizerConfig(name="muon")
    eager_opt, compiled_opt = build_optimizer(eager_model, cfg), build_optimizer(compiled_model,
                                                                                  cfg)
    assert sorted(g["layout"] for g in eager_opt.param_groups if g["kind"] == "muon") == [
        "flatten", "matrix", "split:3"]
    torch._dynamo.reset()
    step = torch.compile(compiled_opt.step, backend="aot_eager", fullgraph=True)
    for seed in range(2):
        for model, opt in ((eager_model, eager_opt), (compiled_model, compiled_opt)):
            opt.zero_grad()
            _loss(model, seed).backward()
        eager_opt.step()
        step()
    # atol 1e-5: the traced AdamW divides by the bias correction in its own op (one rounding
    # more than eager's fused scalar), visible on near-zero biases.
    for a, b in zip(eager_model.parameters(), compiled_model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_compiled_adamw_step_takes_a_gradient_laid_out_unlike_its_parameter():
    """The eager layout guard for torch's fused kernel (a stride comparison) once broke Dynamo
    on a transposed gradient; compiled steps trace their own math and need no guard."""
    from speedtronic.optim import AdamW

    torch.manual_seed(0)
    w = torch.randn(4, 6)
    a, b = torch.nn.Parameter(w.clone()), torch.nn.Parameter(w.clone())
    opt, ref = AdamW([a], lr=1e-2), torch.optim.AdamW([b], lr=1e-2, foreach=False)
    step = torch.compile(opt.step, backend="aot_eager")
    for _ in range(2):
        g = torch.randn(6, 4).t()                                    # (4, 6), column-major
        a.grad, b.grad = g.clone().t().contiguous().t(), g.contiguous()
        step()
        ref.step()
    torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-5, atol=1e-6)


def test_compiled_adamw_with_a_tensor_lr_schedule_compiles_once_and_matches_eager():
    """A tensor lr stays a tensor in the traced step: ``float(lr)`` there broke the graph and
    recompiled on every scheduler step (4 recompiles in 4 steps)."""
    from speedtronic.optim import AdamW

    torch.manual_seed(0)
    w = [torch.randn(4, 6), torch.randn(6)]
    mine = [nn.Parameter(t.clone()) for t in w]
    ref = [nn.Parameter(t.clone()) for t in w]
    opt, eager = AdamW(mine, lr=torch.tensor(1e-2)), AdamW(ref, lr=torch.tensor(1e-2))
    scheds = [torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0 / (1 + s)) for o in (opt,
                                                                                     eager)]
    torch._dynamo.reset()
    dynamo_utils.counters.clear()
    step = torch.compile(lambda: type(opt).step(opt), backend="aot_eager", fullgraph=True)
    for _ in range(6):
        for a, b in zip(mine, ref, strict=True):
            a.grad = torch.randn_like(a)
            b.grad = a.grad.clone()
        step()
        eager.step()
        for s in scheds:
            s.step()
    # 2 graphs: the first step's (state created) and every later one's, however many steps
    assert dynamo_utils.counters["stats"]["unique_graphs"] <= 2
    assert not dynamo_utils.counters.get("recompiles")
    for a, b in zip(mine, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["muon", "muon_plus"])
def test_the_step_plan_exists_before_the_first_compiled_step(name):
    """torch 2.11 (the oldest torch the package accepts) cannot compile a step that adds an
    attribute to the optimizer: the plan was first created inside ``opt.step`` and
    ``torch.compile(opt.step)`` raised there (2.12+ accept it, so this checks the cause). A
    reset or a loaded state replaces the plan; it never leaves the optimizer without one."""
    model = nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 8))
    opt = build_optimizer(model, OptimizerConfig(name="muon", muon_plus=name == "muon_plus"))
    assert opt.__dict__.get("_muon_cache") is not None
    before = opt.__dict__["_muon_cache"]
    opt.reset_state()
    after = opt.__dict__.get("_muon_cache")
    assert after is not None and after is not before
    opt.load_state_dict(opt.state_dict())
    assert opt.__dict__.get("_muon_cache") is not None
