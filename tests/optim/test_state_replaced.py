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
        p.grad = g.to(p.dtype)
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


@pytest.mark.parametrize("kind", ["muon", "hybrid", "adamw_fp16"])
def test_load_state_dict_hooks_decide_what_is_loaded(kind):
    """A pre-hook's edited state dict and a post-hook's replaced state are what the optimizer
    steps with, as in torch.optim: the fp32 restore ran after both and put the original
    momentum (and fp16 models' fp32 moments) back."""
    from speedtronic.optim import AdamW

    def make() -> tuple[torch.optim.Optimizer, list[nn.Parameter]]:
        params = _params()
        if kind == "adamw_fp16":
            params = [nn.Parameter(p.detach().half()) for p in params]
            return AdamW(params, lr=1e-3), params
        return _make(kind, params), params

    def zeroed(opt, state_dict):  # torch's documented way to adapt a loaded state dict
        new = copy.deepcopy(state_dict)
        for st in new["state"].values():
            for key, value in st.items():
                if key != "step" and isinstance(value, torch.Tensor):
                    value.zero_()
        return new

    def replaced(opt):
        for st in opt.state.values():
            for key, value in list(st.items()):
                if key != "step":
                    st[key] = torch.zeros_like(value)

    source, params = make()
    _step(source, params, 0)
    saved = source.state_dict()
    assert any(v.abs().max() > 0 for st in saved["state"].values()
               for k, v in st.items() if k != "step")
    for hook in ("pre", "post"):
        opt, params = make()
        _step(opt, params, 0)
        if hook == "pre":
            opt.register_load_state_dict_pre_hook(zeroed)
        else:
            opt.register_load_state_dict_post_hook(replaced)
        opt.load_state_dict(saved)
        left = {k for st in opt.state.values() for k, v in st.items()
                if k != "step" and v.abs().max() > 0}
        assert not left, (hook, left)


def test_a_matrix_that_stops_getting_gradients_frees_the_old_momentum_bank():
    """Freezing layers one at a time: each frozen matrix's momentum was a view into the bank of
    the plan before, keeping every old bank alive and saved whole (8 layers: 9 MiB held and
    written for 2 MiB of momentum)."""
    import io

    torch.manual_seed(0)
    layers = [nn.Parameter(torch.randn(32, 32)) for _ in range(6)]
    opt = Muon(layers, lr=0.02, ns_dtype="fp32")
    for step in range(len(layers)):
        for i, p in enumerate(layers):
            p.grad = torch.randn(32, 32) if i >= step else None  # one more frozen each step
        opt.step()
    state = opt.state_dict()["state"]
    need = sum(st["momentum_buffer"].numel() * 4 for st in state.values())
    held = {st["momentum_buffer"].untyped_storage().data_ptr():
            st["momentum_buffer"].untyped_storage().nbytes() for st in state.values()}
    assert sum(held.values()) == need
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    assert buf.tell() < need * 1.5

