"""speedtronic.optim.Muon against torch.optim.Muon at equal precision: torch's Newton-Schulz casts
to bf16, ours runs fp32 on CPU, so torch's is swapped here for the same iteration in fp32; then
every option combination must give the same parameters to fp32 rounding, step after step, and
each optimizer must continue the other's state dict identically (docs/optimizers.md, "Drop-in
class")."""

from __future__ import annotations

import itertools

import pytest
import torch

from speedtronic.optim import Muon

torch_muon = pytest.importorskip("torch.optim._muon")
if not hasattr(torch_muon, "_zeropower_via_newtonschulz"):
    pytest.skip("torch.optim.Muon's Newton-Schulz is not where torch 2.13 keeps it",
                allow_module_level=True)

SHAPES = [(24, 24), (16, 40), (40, 16), (7, 13)]  # square, wide, tall, odd


def _ns_fp32(grad: torch.Tensor, coefficients, steps: int, eps: float) -> torch.Tensor:
    """torch's quintic iteration on the wide orientation, in fp32 instead of bf16."""
    a, b, c = coefficients
    tall = grad.size(0) > grad.size(1)
    X = grad.float().mT if tall else grad.float()  # (m, n), m <= n
    X = X / X.norm().clamp(min=eps)
    for _ in range(steps):
        A = X @ X.mT  # (m, m)
        X = a * X + (b * A + c * A @ A) @ X
    return X.mT if tall else X


def _run(cls, kwargs: dict, steps: int = 5, start=None):
    g = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=g)) for s in SHAPES]
    opt = cls(params, **kwargs)
    if start is not None:
        opt.load_state_dict(start)
    history = []
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()
        history.append([p.detach().clone() for p in params])
    return history, opt


COMBOS = list(itertools.product([False, True], [0.0, 0.1], [True, False],
                                [None, "original", "match_rms_adamw"], [5, 3]))


@pytest.mark.parametrize("tensor_lr, weight_decay, nesterov, adjust_lr_fn, ns_steps", COMBOS)
def test_every_option_steps_like_torch_at_equal_precision(monkeypatch, tensor_lr, weight_decay,
                                                          nesterov, adjust_lr_fn, ns_steps):
    monkeypatch.setattr(torch_muon, "_zeropower_via_newtonschulz", _ns_fp32)

    def kwargs():
        lr = torch.tensor(0.02) if tensor_lr else 0.02
        return dict(lr=lr, weight_decay=weight_decay, momentum=0.9, nesterov=nesterov,
                    adjust_lr_fn=adjust_lr_fn, ns_steps=ns_steps)

    theirs, _ = _run(torch.optim.Muon, kwargs())
    ours, _ = _run(Muon, kwargs())
    for step, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        for x, y in zip(a, b, strict=True):
            torch.testing.assert_close(x, y, rtol=0, atol=2e-6, msg=f"step {step}")


def test_each_continues_the_others_state_dict(monkeypatch):
    monkeypatch.setattr(torch_muon, "_zeropower_via_newtonschulz", _ns_fp32)
    kwargs = dict(lr=0.02, weight_decay=0.1, momentum=0.9)
    _, torch_opt = _run(torch.optim.Muon, kwargs, steps=2)
    _, our_opt = _run(Muon, kwargs, steps=2)
    a, _ = _run(Muon, kwargs, steps=3, start=torch_opt.state_dict())
    b, _ = _run(torch.optim.Muon, kwargs, steps=3, start=our_opt.state_dict())
    c, _ = _run(torch.optim.Muon, kwargs, steps=3, start=torch_opt.state_dict())
    for xs, ys, zs in zip(a, b, c, strict=True):
        for x, y, z in zip(xs, ys, zs, strict=True):
            torch.testing.assert_close(x, z, rtol=0, atol=2e-6)
            torch.testing.assert_close(y, z, rtol=0, atol=2e-6)
