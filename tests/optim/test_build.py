"""build_optimizer / HybridOptimizer: one optimizer, every param trained, schedules, state."""

from __future__ import annotations

import io
import logging

import pytest
import torch
from torch import nn

from speedtronic.config import ConfigError, ModelConfig, OptimizerConfig, load_config
from speedtronic.optim import AdamW, HybridOptimizer, build_optimizer
from speedtronic.optim.routing import trainable_parameters


def _model(tie: bool = True) -> nn.Module:
    from speedtronic.models import build_model

    torch.manual_seed(0)
    return build_model(ModelConfig(n_layer=2, d_model=32, n_head=4, vocab_size=48,
                                   max_seq_len=16, tie_weights=tie))


def _train_step(model: nn.Module, opt: torch.optim.Optimizer, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 48, (2, 16), generator=g)
    y = torch.randint(0, 48, (2, 16), generator=g)
    opt.zero_grad()
    model(x, y).backward()
    opt.step()


@pytest.mark.parametrize("name,cautious,muon_plus", [
    ("adamw", False, False), ("adamw", True, False), ("muon", False, False),
    ("muon", True, True)])
def test_every_trainable_param_changes_after_one_step(name, cautious, muon_plus) -> None:
    model = _model()
    frozen = model.blocks[0].attn_norm.weight
    frozen.requires_grad_(False)
    before = {id(p): p.detach().clone() for p in model.parameters()}
    opt = build_optimizer(model, OptimizerConfig(name=name, cautious=cautious,
                                                 muon_plus=muon_plus))
    assert isinstance(opt, torch.optim.Optimizer)
    covered = [id(p) for g in opt.param_groups for p in g["params"]]
    assert sorted(covered) == sorted(id(p) for p in trainable_parameters(model))
    _train_step(model, opt)
    unchanged = [n for n, p in model.named_parameters()
                 if p.requires_grad and torch.equal(p, before[id(p)])]
    assert unchanged == []
    assert torch.equal(frozen, before[id(frozen)])


def test_branch_hyperparameters_and_no_decay_groups() -> None:
    cfg = OptimizerConfig(name="muon", lr=1e-3, weight_decay=0.05, muon_lr=0.03,
                          muon_weight_decay=0.02)
    opt = build_optimizer(_model(), cfg)
    by_name = {g["name"]: g for g in opt.param_groups}
    assert by_name["muon"]["kind"] == "muon" and by_name["muon"]["lr"] == 0.03
    assert by_name["muon"]["weight_decay"] == 0.02
    assert by_name["adamw_no_decay"]["weight_decay"] == 0.0
    assert "adamw_decay" not in by_name  # reference model: embeddings + norms only
    opt = build_optimizer(_model(), OptimizerConfig(name="muon", decay_embeddings=True,
                                                    decay_norms_and_biases=True))
    assert {g["name"] for g in opt.param_groups} == {"muon", "adamw_decay"}


def test_adamw_covers_hidden_matrices_with_decay() -> None:
    opt = build_optimizer(_model(), OptimizerConfig(name="adamw", weight_decay=0.1))
    kinds = {g["kind"] for g in opt.param_groups}
    assert kinds == {"adamw"}
    decay = next(g for g in opt.param_groups if g["name"] == "adamw_decay")
    assert len(decay["params"]) == 14 and decay["weight_decay"] == 0.1


def test_lambda_lr_scales_both_branches_keeping_ratio() -> None:
    model = _model()
    opt = build_optimizer(model, OptimizerConfig(name="muon", lr=1e-3, muon_lr=0.02))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5 ** step)
    _train_step(model, opt)
    sched.step()
    _train_step(model, opt)
    sched.step()
    lrs = {g["name"]: g["lr"] for g in opt.param_groups}
    assert lrs["muon"] == pytest.approx(0.005) and lrs["adamw_no_decay"] == pytest.approx(2.5e-4)


def test_state_dict_roundtrips_weights_only_and_resumes_identically() -> None:
    cfg = OptimizerConfig(name="muon", cautious=True, muon_coefficients="polar_express")
    model = _model()
    opt = build_optimizer(model, cfg)
    _train_step(model, opt, seed=1)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    buf.seek(0)
    ckpt = torch.load(buf, weights_only=True)
    _train_step(model, opt, seed=2)

    resumed = _model()
    resumed.load_state_dict(ckpt["model"])
    opt2 = build_optimizer(resumed, cfg)
    opt2.load_state_dict(ckpt["opt"])
    _train_step(resumed, opt2, seed=2)
    for a, b in zip(model.parameters(), resumed.parameters(), strict=True):
        assert torch.allclose(a, b, atol=1e-6)


def test_adamw_state_layout_is_the_same_on_fused_and_op_paths() -> None:
    model = _model()
    fused = build_optimizer(model, OptimizerConfig(name="adamw", fused=True))
    _train_step(model, fused)
    other = _model()
    other.load_state_dict(model.state_dict())
    op_path = build_optimizer(other, OptimizerConfig(name="adamw", fused=False, cautious=True))
    op_path.load_state_dict(fused.state_dict())  # fused checkpoint -> cautious op path
    for group in op_path.param_groups:  # like torch, loading restores saved hyperparameters
        assert group["fused"] is True
        group.update(fused=False, cautious=True)
    _train_step(other, op_path, seed=3)
    a, b = fused.state_dict()["state"][0], op_path.state_dict()["state"][0]
    assert set(a) == set(b) == {"step", "exp_avg", "exp_avg_sq"}
    assert a["step"].item() == 1 and b["step"].item() == 2


def test_fused_and_op_adamw_agree() -> None:
    results = []
    for fused in (True, False):
        model = _model()
        opt = build_optimizer(model, OptimizerConfig(name="adamw", fused=fused))
        for s in range(3):
            _train_step(model, opt, seed=s)
        results.append([p.detach().clone() for p in model.parameters()])
    for a, b in zip(*results, strict=True):
        assert torch.allclose(a, b, atol=1e-5)


def test_reset_state_clears_both_branches() -> None:
    model = _model()
    opt = build_optimizer(model, OptimizerConfig(name="muon"))
    _train_step(model, opt)
    kinds = {k for st in opt.state.values() for k in st}
    assert {"momentum_buffer", "exp_avg"} <= kinds
    lr_before = [g["lr"] for g in opt.param_groups]
    opt.reset_state()
    assert len(opt.state) == 0 and [g["lr"] for g in opt.param_groups] == lr_before
    _train_step(model, opt)  # state re-initializes cleanly


def test_loading_a_checkpoint_of_the_other_optimizer_is_a_clear_error() -> None:
    model = _model()
    sd = build_optimizer(model, OptimizerConfig(name="adamw")).state_dict()
    opt = build_optimizer(model, OptimizerConfig(name="muon"))
    with pytest.raises(ValueError, match="different optimizer.name"):
        opt.load_state_dict(sd)


def test_config_errors_and_capability_log(caplog) -> None:
    with pytest.raises(ConfigError, match="muon_plus"):
        load_config({"optimizer": {"name": "adamw", "muon_plus": True}})
    frozen = nn.Linear(2, 2).requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable parameters"):
        build_optimizer(frozen, OptimizerConfig())
    with caplog.at_level(logging.INFO, logger="speedtronic.optim"):
        build_optimizer(_model(), OptimizerConfig(name="muon"))
    assert any("muon branch: Newton-Schulz fp32 (auto, no CUDA)" in r.message
               for r in caplog.records)


def test_muon_without_matrices_falls_back_to_adamw() -> None:
    model = nn.Sequential(nn.Conv1d(2, 2, 3))
    opt = build_optimizer(model, OptimizerConfig(name="muon"))
    assert {g["kind"] for g in opt.param_groups} == {"adamw"}


def test_momentum_cycling_schedulers_drive_both_branches() -> None:
    # OneCycleLR / CyclicLR write group["momentum"] on every group (defaults has "momentum");
    # Muon uses it as its own, AdamW as beta1, as each would under the scheduler alone.
    from torch.optim.lr_scheduler import CyclicLR, OneCycleLR

    m = nn.Sequential(nn.Embedding(50, 16), nn.Linear(16, 16), nn.Linear(16, 50))
    opt = build_optimizer(m, load_config({"optimizer": "muon"}).optimizer)
    sched = OneCycleLR(opt, max_lr=0.01, total_steps=10)
    seen = []
    for _ in range(4):
        for p in m.parameters():
            p.grad = torch.randn_like(p)
        opt.step()
        seen.append({g["kind"]: (g["momentum"], g.get("betas")) for g in opt.param_groups})
        sched.step()
    muon_momenta = [s["muon"][0] for s in seen]
    assert len(set(muon_momenta)) == 4  # cycled
    for s in seen:
        assert s["adamw"][1][0] == s["adamw"][0]  # beta1 followed the scheduler's momentum
    CyclicLR(build_optimizer(m, load_config({"optimizer": "muon"}).optimizer), 1e-4, 1e-2)


def test_rejected_hybrid_param_group_is_not_kept() -> None:
    opt = build_optimizer(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8)),
                          load_config({"optimizer": "muon"}).optimizer)
    before = len(opt.param_groups)
    with pytest.raises(ValueError):
        opt.add_param_group({"kind": "adamw", "params": [nn.Parameter(torch.randn(3))],
                             "betas": (2.0, 0.9)})
    assert len(opt.param_groups) == before


def test_build_optimizer_takes_the_yaml_section_as_a_dict_or_a_name() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    from_dict = build_optimizer(model, {"name": "muon", "muon_lr": 0.03})
    assert {g["kind"] for g in from_dict.param_groups} == {"muon", "adamw"}
    assert float(next(g for g in from_dict.param_groups if g["kind"] == "muon")["lr"]) == \
        pytest.approx(0.03)
    assert {g["kind"] for g in build_optimizer(model, "adamw").param_groups} == {"adamw"}
    with pytest.raises(ConfigError, match="optimizer.muon_lrr"):  # checked as YAML is
        build_optimizer(model, {"name": "muon", "muon_lrr": 0.03})
    with pytest.raises(TypeError, match="must be an OptimizerConfig, a dict"):
        build_optimizer(model, 0.02)


def test_fused_and_cautious_adamw_are_refused_together() -> None:
    """torch's fused kernel has no cautious mask: fused=True was ignored without a word."""
    with pytest.raises(ValueError, match="fused=True cannot be combined with cautious=True"):
        AdamW([nn.Parameter(torch.ones(3))], fused=True, cautious=True)
    with pytest.raises(ConfigError, match="optimizer.fused"):
        load_config({"optimizer": {"fused": True, "cautious": True}})


def test_hybrid_group_validation() -> None:
    with pytest.raises(ValueError, match="'kind'"):
        HybridOptimizer([{"params": [nn.Parameter(torch.ones(2))]}])
    with pytest.raises(ValueError, match="2D parameters"):
        HybridOptimizer([{"params": [nn.Parameter(torch.ones(2))], "kind": "muon"}])


def test_standalone_cautious_adamw_matches_torch_when_not_cautious() -> None:
    torch.manual_seed(0)
    w = torch.randn(6, 5)
    grads = [torch.randn(6, 5) for _ in range(3)]
    outs = [_stepped(make, w, grads) for make in (
        lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
        lambda ps: AdamW(ps, lr=1e-2, weight_decay=0.1, fused=False))]
    assert torch.allclose(outs[0], outs[1], atol=1e-6)


def _stepped(make, w: torch.Tensor, grads: list[torch.Tensor]) -> torch.Tensor:
    """The weights ``w`` after one step of ``make([param])`` per gradient."""
    p = nn.Parameter(w.clone())
    opt = make([p])
    for g in grads:
        p.grad = g.clone()
        opt.step()
    return p.detach()


@pytest.mark.parametrize("kwargs", [{}, {"fused": False}, {"cautious": True}])
def test_adamw_update_does_not_depend_on_the_gradient_layout(kwargs) -> None:
    """A gradient laid out unlike its parameter (a transposed view) gives the same update: torch's
    fused kernel alone read it as if laid out like the parameter (2 x lr off)."""
    torch.manual_seed(0)
    w, g = torch.randn(4, 6), torch.randn(6, 4).T  # (4, 6), column-major
    assert not g.is_contiguous()
    outs = []
    for grad in (g, g.contiguous()):
        p = nn.Parameter(w.clone())
        opt = AdamW([p], lr=1e-2, **kwargs)
        p.grad = grad
        opt.step()
        outs.append(p.detach())
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)


@pytest.mark.parametrize("fused", [None, True, False])
def test_adamw_matches_torch_for_a_strided_parameter_and_moments_of_another_layout(fused):
    """torch's fused kernel walks parameter and moments as one flat layout: a parameter with
    gaps (big[::2]), and a model moved to channels_last after its first steps (contiguous
    moments, channels_last weights), were updated up to 2.6 lr off on the default path.
    torch.optim.AdamW's own default (foreach) is the reference."""
    torch.manual_seed(0)
    big, grads = torch.randn(16, 5), [torch.randn(8, 5) for _ in range(3)]
    p_ref, p = (nn.Parameter(big.clone()[::2]) for _ in range(2))
    ref, ours = torch.optim.AdamW([p_ref], lr=1e-2), AdamW([p], lr=1e-2, fused=fused)
    assert not p.is_contiguous()
    for g in grads:
        p_ref.grad, p.grad = g.clone(), g.clone()
        ref.step()
        ours.step()
    torch.testing.assert_close(p.detach(), p_ref.detach(), rtol=1e-6, atol=1e-6)

    w, grads = torch.randn(3, 4, 5, 6), [torch.randn(3, 4, 5, 6) for _ in range(4)]
    p_ref, p = nn.Parameter(w.clone()), nn.Parameter(w.clone())
    ref, ours = torch.optim.AdamW([p_ref], lr=1e-2), AdamW([p], lr=1e-2, fused=fused)
    for k, g in enumerate(grads):
        if k == 2:  # model.to(memory_format=torch.channels_last) between steps
            for q in (p_ref, p):
                q.data = q.data.to(memory_format=torch.channels_last)
        p_ref.grad, p.grad = g.clone(), g.clone().to(memory_format=torch.channels_last)
        ref.step()
        ours.step()
    torch.testing.assert_close(p.detach(), p_ref.detach(), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("kwargs", [{}, {"fused": False}])
def test_adamw_updates_complex_parameters_like_torch(kwargs) -> None:
    torch.manual_seed(0)
    w, grads = torch.randn(3, 4, dtype=torch.cfloat), [torch.randn(3, 4, dtype=torch.cfloat)
                                                       for _ in range(2)]
    outs = [_stepped(make, w, grads) for make in (
        lambda ps: torch.optim.AdamW(ps, lr=1e-2), lambda ps: AdamW(ps, lr=1e-2, **kwargs))]
    assert not torch.equal(outs[1].imag, w.imag)  # the imaginary part moved (it was wiped)
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-6, atol=1e-6)
    model = nn.Linear(4, 4)
    model.register_parameter("phase", nn.Parameter(w.clone()))
    opt = build_optimizer(model, OptimizerConfig(name="muon"))
    model.phase.grad = grads[0].clone()
    opt.step()
    assert not torch.equal(model.phase.imag, w.imag)


def test_cautious_adamw_keeps_fp16_entries_with_zero_gradient_finite() -> None:
    """eps = 1e-8 is 0 in fp16: the fallback computes the direction in fp32 (it gave NaN)."""
    p = nn.Parameter(torch.ones(1, 4, dtype=torch.float16))
    opt = AdamW([p], lr=1e-3, cautious=True)
    p.grad = torch.tensor([[0.5, 0.0, -0.25, 0.0]], dtype=torch.float16)
    opt.step()
    assert torch.isfinite(p).all()
    assert p[0, 1].item() == 1.0 and p[0, 0].item() < 1.0 < p[0, 2].item()


@pytest.mark.parametrize("field, value", [("name", "Muon"), ("name", "sgd"),
                                          ("muon_ns_dtype", "float16"), ("lr", float("inf"))])
def test_build_optimizer_validates_a_config_built_in_python(field, value) -> None:
    """The YAML loader's checks also hold for a dataclass built in Python ("Muon" once built an
    all-AdamW optimizer without a word)."""
    cfg = OptimizerConfig(**{field: value})
    with pytest.raises(ConfigError, match=f"optimizer.{field}"):
        build_optimizer(nn.Linear(4, 4), cfg)


@pytest.mark.parametrize("order", ["16-bit first", "fp32 first"])
def test_the_adamw_fallback_on_mixed_dtypes_keeps_fp32_state_exact(order) -> None:
    """The fp32 upcast of 16-bit state once took its cue from the first tensor of a chunk: an
    fp32 parameter behind a 16-bit one had its exp_avg_sq overwritten by its square root (NaN
    soon after), and an fp16 one behind an fp32 one lost the upcast."""
    torch.manual_seed(0)
    w32, w16 = torch.randn(3, 4), torch.randn(5)
    grads = [(torch.randn(3, 4), torch.randn(5)) for _ in range(3)]
    p32, p16 = nn.Parameter(w32.clone()), nn.Parameter(w16.clone().to(torch.float16))
    params = [p16, p32] if order == "16-bit first" else [p32, p16]
    opt = AdamW(params, lr=1e-2, fused=False)
    ref = nn.Parameter(w32.clone())
    ref_opt = torch.optim.AdamW([ref], lr=1e-2)
    for g32, g16 in grads:
        p32.grad, p16.grad, ref.grad = g32.clone(), g16.to(torch.float16), g32.clone()
        p16.grad[0] = 0.0  # an entry with no gradient: v = m = 0 there
        opt.step()
        ref_opt.step()
    torch.testing.assert_close(p32.detach(), ref.detach(), rtol=1e-6, atol=1e-7)
    assert torch.isfinite(p16).all()


@pytest.mark.parametrize("flag", ["maximize", "amsgrad"])
def test_a_torch_adamw_state_with_maximize_or_amsgrad_is_refused_and_nothing_changes(flag):
    """Loaded, they were kept in param_groups and never read: a maximizing run went on
    minimizing without a word."""
    torch.manual_seed(0)
    p = nn.Parameter(torch.randn(4))
    ref = torch.optim.AdamW([p], lr=1e-2, **{flag: True})
    p.grad = torch.randn(4)
    ref.step()
    opt = AdamW([p], lr=3e-3)
    opt.step()
    before = opt.state_dict()
    with pytest.raises(ValueError, match=f"{flag}=True"):
        opt.load_state_dict(ref.state_dict())
    after = opt.state_dict()
    assert after["param_groups"] == before["param_groups"]
    assert torch.equal(after["state"][0]["exp_avg"], before["state"][0]["exp_avg"])
    opt.load_state_dict(torch.optim.AdamW([p], lr=1e-2).state_dict())  # plain: still loads
    assert opt.param_groups[0]["lr"] == 1e-2


@pytest.mark.parametrize("cautious,fused", [(False, None), (True, None), (False, False)])
def test_adamw_keeps_float32_moments_for_float16_parameters(cautious, fused):
    """float16 moments underflow: (1 - beta2) g^2 is 0 below |g| ~7.7e-3, and a 5e-3 gradient
    moved a weight by 250 in one step. float16 weights now follow a float32 AdamW within their
    own rounding, beside float32 parameters on torch's fused kernel, and keep float32 moments
    through a state_dict round trip (torch's load casts state to the parameter dtype)."""
    half = nn.Parameter(torch.zeros(8, dtype=torch.float16))
    full = nn.Parameter(torch.zeros(8))
    ref = nn.Parameter(torch.zeros(8))
    opt = AdamW([half, full], lr=1e-3, weight_decay=0.1, cautious=cautious, fused=fused)
    ref_opt = AdamW([ref], lr=1e-3, weight_decay=0.1, cautious=cautious, fused=fused)
    for step in range(20):
        g = torch.full((8,), 5e-3) * (1 + step % 3)
        half.grad, full.grad, ref.grad = g.half(), g.clone(), g.clone()
        opt.step()
        ref_opt.step()
    assert opt.state[half]["exp_avg_sq"].dtype == torch.float32
    torch.testing.assert_close(half.float(), ref.detach(), rtol=2e-3, atol=1e-5)
    torch.testing.assert_close(full.detach(), ref.detach())
    again = AdamW([nn.Parameter(half.detach().clone()), nn.Parameter(full.detach().clone())],
                  lr=1e-3, weight_decay=0.1, cautious=cautious, fused=fused)
    again.load_state_dict(opt.state_dict())
    state = list(again.state.values())
    assert [s["exp_avg"].dtype for s in state] == [torch.float32, torch.float32]
    assert torch.equal(state[0]["exp_avg_sq"], opt.state[half]["exp_avg_sq"])


def test_float32_moments_loaded_into_bfloat16_parameters_follow_torch_s_rule():
    """Only float16 parameters keep float32 moments on load; a float32 run's checkpoint loaded
    into bfloat16 parameters gets bfloat16 moments, as torch.optim.AdamW gives."""
    full = nn.Parameter(torch.randn(4))
    opt = AdamW([full], lr=1e-3)
    full.grad = torch.randn(4)
    opt.step()
    bf = nn.Parameter(full.detach().to(torch.bfloat16))
    again = AdamW([bf], lr=1e-3)
    again.load_state_dict(opt.state_dict())
    assert again.state[bf]["exp_avg"].dtype == torch.bfloat16


def test_a_torch_adamw_float16_state_is_upcast_at_the_next_step():
    half = nn.Parameter(torch.zeros(4, dtype=torch.float16))
    theirs = torch.optim.AdamW([half], lr=1e-3)
    half.grad = torch.full((4,), 0.5, dtype=torch.float16)
    theirs.step()
    opt = AdamW([half], lr=1e-3)
    opt.load_state_dict(theirs.state_dict())
    assert opt.state[half]["exp_avg"].dtype == torch.float16  # as saved
    opt.step()
    assert opt.state[half]["exp_avg"].dtype == opt.state[half]["exp_avg_sq"].dtype \
        == torch.float32


def test_python_built_config_values_other_than_strings_still_reach_the_optimizer() -> None:
    """The choices check refuses unknown strings only: a torch dtype or None for muon_ns_dtype
    worked before it and still does."""
    for value, name in ((torch.bfloat16, "bf16"), (None, "auto")):
        opt = build_optimizer(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8)),
                              OptimizerConfig(name="muon", muon_ns_dtype=value))
        assert {g["ns_dtype"] for g in opt.param_groups if "ns_dtype" in g} == {name}


@pytest.mark.parametrize("hybrid", [True, False])
def test_a_sparse_adamw_gradient_is_refused_before_any_parameter_moves(hybrid) -> None:
    # the Muon matrices (and earlier AdamW groups) were updated before AdamW raised
    weight = nn.Parameter(torch.randn(8, 8))
    bias = nn.Parameter(torch.randn(8))
    table = nn.Parameter(torch.randn(5, 8))
    if hybrid:
        opt = HybridOptimizer([{"params": [weight], "kind": "muon"},
                               {"params": [bias], "kind": "adamw"},
                               {"params": [table], "kind": "adamw"}])
    else:
        opt = AdamW([{"params": [weight]}, {"params": [bias]}, {"params": [table]}])
    for p in (weight, bias):
        p.grad = torch.randn_like(p)
    table.grad = torch.randn(5, 8).to_sparse()
    before = [p.detach().clone() for p in (weight, bias, table)]
    with pytest.raises(RuntimeError, match="sparse gradients.*shape \\(5, 8\\)"):
        opt.step()
    for p, b in zip((weight, bias, table), before, strict=True):
        assert torch.equal(p, b)
    assert not opt.state or all(not st for st in opt.state.values())
