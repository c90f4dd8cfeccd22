"""Muon keeps its momentum in per-shape banks between steps; these tests pin that replacing the
optimizer state from outside (``load_state_dict`` into an optimizer that already stepped,
``reset_state``, ``state.clear()``) reaches the next step, eager and compiled, exactly as it
would reach a freshly built optimizer. Before the fix the plan checked the old per-parameter
dicts, kept stepping the old banks after either, and saved no momentum after a reset."""

from __future__ import annotations

import copy

import pytest
import torch
from _engine_fixtures import one_thread  # noqa: F401
from torch import nn

from speedtronic.optim import HybridOptimizer, Muon

pytestmark = pytest.mark.usefixtures("one_thread")

# a square pair, a wide and a tall matrix (the tall one joins the wide group transposed)
SHAPES = [(8, 8), (8, 8), (8, 24), (24, 8)]


def _params(seed: int = 0) -> list[nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [nn.Parameter(torch.randn(*s, generator=g)) for s in SHAPES]


def _grads(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + seed)
    return [torch.randn(*s, generator=g) for s in SHAPES]


def _make(kind: str, params: list[nn.Parameter]) -> torch.optim.Optimizer:
    if kind == "muon":
        return Muon(params, lr=0.02, weight_decay=0.01)
    vector = nn.Parameter(torch.ones(5))  # an AdamW group beside the Muon one
    return HybridOptimizer([{"kind": "muon", "params": params, "lr": 0.02},
                            {"kind": "adamw", "params": [vector], "lr": 1e-3}])


def _step(opt: torch.optim.Optimizer, params: list[nn.Parameter], seed: int, step=None) -> None:
    for p, g in zip(params, _grads(seed), strict=True):
        p.grad = g.clone()
    for group in opt.param_groups:
        for p in group["params"]:
            if p.grad is None:
                p.grad = torch.full_like(p, 0.1)
    (step or opt.step)()


@pytest.mark.parametrize("kind", ["muon", "hybrid"])
def test_load_state_dict_into_a_stepped_optimizer_matches_a_fresh_one(kind):
    params = _params()
    opt = _make(kind, params)
    _step(opt, params, 0)
    saved = copy.deepcopy(opt.state_dict())
    weights = [p.detach().clone() for p in params]
    _step(opt, params, 1)  # moves the banks past the checkpoint
    opt.load_state_dict(copy.deepcopy(saved))
    with torch.no_grad():
        for p, w in zip(params, weights, strict=True):
            p.copy_(w)
    _step(opt, params, 2)

    fresh_params = [nn.Parameter(w.clone()) for w in weights]
    fresh = _make(kind, fresh_params)
    fresh.load_state_dict(copy.deepcopy(saved))
    _step(fresh, fresh_params, 2)
    for p, q in zip(params, fresh_params, strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=0)
    for p, q in zip(params, fresh_params, strict=True):
        torch.testing.assert_close(opt.state[p]["momentum_buffer"],
                                   fresh.state[q]["momentum_buffer"], rtol=0, atol=0)


@pytest.mark.parametrize("reset", ["reset_state", "state.clear"])
def test_a_reset_starts_momentum_at_zero_and_is_saved_again(reset):
    params = _params()
    opt = _make("hybrid", params)
    _step(opt, params, 0)
    _step(opt, params, 1)
    opt.reset_state() if reset == "reset_state" else opt.state.clear()
    weights = [p.detach().clone() for p in params]
    _step(opt, params, 2)

    fresh_params = [nn.Parameter(w.clone()) for w in weights]
    fresh = _make("hybrid", fresh_params)
    _step(fresh, fresh_params, 2)
    for p, q in zip(params, fresh_params, strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=0)
    saved = opt.state_dict()["state"]
    for index, q in enumerate(fresh_params):
        torch.testing.assert_close(saved[index]["momentum_buffer"],
                                   fresh.state[q]["momentum_buffer"], rtol=0, atol=0)


def test_a_compiled_step_sees_a_loaded_state():
    """The traced step does not re-check the plan (that would allocate inside the graph):
    ``load_state_dict`` drops it eagerly instead."""
    params = _params()
    opt = _make("muon", params)
    step = torch.compile(opt.step, backend="aot_eager")
    _step(opt, params, 0)  # eager warm-up, as the docs say
    _step(opt, params, 1, step)
    saved = copy.deepcopy(opt.state_dict())
    weights = [p.detach().clone() for p in params]
    _step(opt, params, 2, step)
    opt.load_state_dict(copy.deepcopy(saved))
    with torch.no_grad():
        for p, w in zip(params, weights, strict=True):
            p.copy_(w)
    _step(opt, params, 3, step)

    fresh_params = [nn.Parameter(w.clone()) for w in weights]
    fresh = _make("muon", fresh_params)
    fresh.load_state_dict(copy.deepcopy(saved))
    _step(fresh, fresh_params, 3)
    for p, q in zip(params, fresh_params, strict=True):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
